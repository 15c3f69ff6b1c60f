"""Two FSDP2 ranks under torchrun (gloo, CPU) compute what one process computes.

One torchrun launch runs every scenario of ``fsdp_worker.py``; the single-process reference runs
the same worker in this process (a one-rank group: the same sharded code path).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

WORKER = Path(__file__).with_name("fsdp_worker.py")
REPO = Path(__file__).resolve().parents[2]


def run(cmd, out: Path):
    out.mkdir(parents=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("fsdp")
    (base / "one").mkdir()
    spec = importlib.util.spec_from_file_location("splice_fsdp_worker", WORKER)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    worker.main(str(tiny_model_dir), str(base / "one"))  # the single-process reference, in this process
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(WORKER), str(tiny_model_dir), str(base / "two")], base / "two")
    load = lambda p: torch.load(p, weights_only=False)  # noqa: E731
    return base, load(base / "one" / "rank0.pt"), load(base / "two" / "rank0.pt"), load(base / "two" / "rank1.pt")


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors")


def assert_weights_close(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0), k


def test_gradients_match_single_process(runs):
    _, one, two0, two1 = runs
    assert len(one["grads"]) == len(two0["grads"]) == 2  # two minibatches
    for mb_one, mb_two0, mb_two1 in zip(one["grads"], two0["grads"], two1["grads"]):
        for g1, g20, g21 in zip(mb_one, mb_two0, mb_two1):
            assert torch.equal(g20, g21)  # reduce-scattered shards, gathered: the same on every rank
            torch.testing.assert_close(g20, g1, atol=1e-6, rtol=1e-4)
        assert any(g.abs().sum() > 0 for g in mb_one)


def test_each_rank_is_sent_only_its_share(runs):
    _, one, two0, two1 = runs
    assert len(one["received"]) == 9  # one rank: everything
    assert two0["received"] and two1["received"]
    assert not set(two0["received"]) & set(two1["received"])
    assert sorted(two0["received"] + two1["received"]) == sorted(one["received"])


def test_stats_are_over_all_ranks(runs):
    _, one, two0, two1 = runs
    for key in ("loss", "loss_tokens", "behav_imp_weight_mean", "behav_imp_weight_std", "behav_imp_weight_max",
                "clip_frac", "entropy_mean", "grad_norm"):
        assert two0["stats"][key] == pytest.approx(one["stats"][key], rel=1e-4, abs=1e-6), key
        assert two1["stats"][key] == two0["stats"][key], key
    assert two0["stats"]["imbalance"] >= 1.0 and one["stats"]["imbalance"] == 1.0


def test_full_train_step_gives_the_same_weights(runs):
    base, one, two0, _ = runs
    assert_weights_close(weights(base / "two" / "train" / "step_1"), weights(base / "one" / "train" / "step_1"), 1e-5)
    assert one["history"][0]["n_samples"] == two0["history"][0]["n_samples"] == 9


def test_fewer_samples_than_ranks_trains(runs, tiny_model_dir):
    """Minibatches of one sample on two ranks: one rank runs a zero-weight step in every
    collective of each minibatch; nothing crashes or hangs, and it trains like one process."""
    base, one, two0, two1 = runs
    h = two0["one_history"][0]
    assert h["n_samples"] == 3 and h["n_minibatches"] == 3 and h["loss_tokens"] > 0
    assert two1["one_history"][0]["loss"] == two0["one_history"][0]["loss"]
    start = load_file(tiny_model_dir / "model.safetensors")
    two = weights(base / "two" / "one_sample" / "step_1")
    assert any(not torch.equal(start[k], two[k]) for k in start)  # it trained
    assert_weights_close(two, weights(base / "one" / "one_sample" / "step_1"), 1e-5)


@pytest.mark.parametrize("world", ["one", "two"])
def test_resume_equals_uninterrupted(runs, world):
    base = runs[0]
    straight = weights(base / world / "straight" / "step_2")
    resumed = weights(base / world / "resumed" / "step_2")
    assert_weights_close(resumed, straight, 0.0)  # same world size: bit for bit
    # it really resumed: the second run did only step 2, from the checkpoint of step 1
    result = runs[1] if world == "one" else runs[2]
    assert [h["step"] for h in result["resumed"]] == [2]
    assert [h["step"] for h in result["straight"]] == [1, 2]
    assert result["resumed"][0]["loss"] == result["straight"][1]["loss"]


def test_a_two_rank_checkpoint_loads_into_one_process(runs, tiny_model_dir):
    """DCP reshards on load: the 2-rank checkpoint of step 2, loaded at world size 1, holds the
    weights rank 0 published at step 2, and AdamW's state for every parameter."""
    from trainer_bridge.checkpoint import load_checkpoint
    from trainer_bridge.config import TrainConfig
    from trainer_bridge.distributed import Dist
    from trainer_bridge.train import build_learner, full_state_dict

    base = runs[0]
    learner = build_learner(TrainConfig(proxies=["u"], model=str(tiny_model_dir)), Dist())
    state = load_checkpoint(learner.policy, learner.optimizer, base / "two" / "resumed" / "checkpoints" / "step_2", Dist())
    assert state["step"] == 2 and state["world_size"] == 2
    loaded = full_state_dict(learner)
    published = weights(base / "two" / "resumed" / "step_2")
    assert_weights_close({k: loaded[k] for k in published}, published, 0.0)
    assert len(learner.optimizer.state) == len(list(learner.policy.parameters()))
    # two training steps of two minibatches each: four AdamW steps, counted across the resume
    assert {float(s["step"]) for s in learner.optimizer.state.values()} == {4.0}
