"""Per-step reporting the demo relies on: reward spread over sessions, the sessions a step
trained on, and the trainer/engine gap on the engine's recomputed pi_{v+1} values."""

from __future__ import annotations

import json
import math

import pytest
import torch

from splice_trainer_testlib import make_samples
from trainer_bridge.config import TrainConfig, config_from_argv
from trainer_bridge.distributed import Dist
from trainer_bridge.policy import load_causal_lm
from trainer_bridge.train import build_learner, learner_step, prepare_batch, train


def _config(tiny_model_dir, tmp_path, **kw) -> TrainConfig:
    base = dict(proxies=["unused"], model=str(tiny_model_dir), out=str(tmp_path), micro_batch_tokens=48, lr=0.0,
                progress=False, pull_wait_s=0.1)
    base.update(kw)
    return TrainConfig(**base)


def test_reward_stats_are_over_distinct_sessions(tiny_model_dir, tmp_path):
    samples = make_samples(n_groups=2, group_size=3, seed=2)  # each group's first session forked: 2 samples
    rewards = {s["session_id"]: s["reward"] for s in samples}
    assert len(rewards) == 6 and len(samples) == 8
    _, _, info = prepare_batch(samples, 5, _config(tiny_model_dir, tmp_path))
    values = list(rewards.values())
    mean = sum(values) / len(values)
    assert info["reward_mean"] == pytest.approx(mean)
    assert info["reward_std"] == pytest.approx(math.sqrt(sum((r - mean) ** 2 for r in values) / len(values)))
    assert (info["reward_min"], info["reward_max"]) == (min(values), max(values))


def _exact_logprobs(model, ids):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    return [0.0] + [torch.log_softmax(logits[i - 1], -1)[ids[i]].item() for i in range(1, len(ids))]


def test_recomputed_gap_compares_each_token_with_its_own_value(tiny_model_dir, tmp_path):
    """Tokens sampled by v-1 whose pi_v the engine recomputed: the trainer (holding v) must
    agree with that value token for token, and a one-position shift must show."""
    model = load_causal_lm(str(tiny_model_dir))
    samples = make_samples(n_groups=2, group_size=2, seed=7, min_len=6, max_len=26)
    for s in samples:
        exact = _exact_logprobs(model, s["input_ids"])
        s["versions"] = [4 if m else -1 for m in s["loss_mask"]]
        s["proximal_versions"] = [5 if m else -1 for m in s["loss_mask"]]
        s["proximal_logprobs_t"] = [lp if m else 0.0 for lp, m in zip(exact, s["loss_mask"])]
        s["logprobs"] = [lp - 0.3 if m else 0.0 for lp, m in zip(exact, s["loss_mask"])]  # pi_4 != pi_5
    cfg = _config(tiny_model_dir, tmp_path)
    learner = build_learner(cfg, Dist())
    n_loss = sum(sum(s["loss_mask"]) for s in samples)

    stats = learner_step(learner, samples, [1.0] * len(samples), cfg, step=1, version=5)
    assert stats["engine_prox_gap_tokens"] == n_loss
    assert stats["engine_prox_gap_abs_max"] < 1e-5
    assert stats["engine_gap_tokens"] == 0  # nothing was sampled by version 5 itself

    shifted = [dict(s, proximal_logprobs_t=s["proximal_logprobs_t"][1:] + [0.0]) for s in samples]
    stats = learner_step(learner, shifted, [1.0] * len(samples), cfg, step=2, version=5)
    assert stats["engine_prox_gap_abs_max"] > 0.5

    # tokens whose value was never recomputed (proximal version == version) are not counted
    missing = [dict(s, proximal_versions=list(s["versions"])) for s in samples]
    stats = learner_step(learner, missing, [1.0] * len(samples), cfg, step=3, version=5)
    assert stats["engine_prox_gap_tokens"] == 0


class _Client:
    def __init__(self, batches):
        self.batches = list(batches)

    def version(self):
        return 5

    def pull(self, max_samples, wait_s):
        batch = self.batches.pop(0) if self.batches else []
        return ("L" if batch else None), batch

    def ack(self, lease):
        pass

    def publish(self, path, version):
        pass


def test_log_sessions_lists_the_sessions_trained_on(tiny_model_dir, tmp_path):
    fresh = make_samples(n_groups=1, group_size=2, seed=1, prefix="new")
    stale = make_samples(n_groups=1, group_size=2, seed=2, version=0, prefix="old")  # dropped as too stale
    cfg = _config(tiny_model_dir, tmp_path, log_sessions=True, max_staleness=2, steps=1)
    history = train(cfg, client=_Client([fresh + stale]))
    assert history[0]["session_ids"] == sorted({s["session_id"] for s in fresh})
    line = json.loads((tmp_path / "stats.jsonl").read_text().splitlines()[0])
    assert line["session_ids"] == history[0]["session_ids"]
    assert "reward_std" in line and "engine_prox_gap_abs_max" in line

    history = train(_config(tiny_model_dir, tmp_path / "quiet", steps=1), client=_Client([fresh]))
    assert "session_ids" not in history[0]  # off by default: stats lines stay small


def test_log_sessions_flag():
    assert config_from_argv(["--proxy", "http://a", "--model", "/m", "--log-sessions"]).log_sessions is True
    assert config_from_argv(["--proxy", "http://a", "--model", "/m"]).log_sessions is False
