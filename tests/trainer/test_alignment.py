"""Token coordinates end to end (docs/design.md section 2; seed 000 bug 2).

A behaviour logprob must only ever be compared with the logprob of the *same* token. The
samples here carry, for every sampled token, the exact logprob the model gives it (what an
engine at the same weights reports) and a distinct per-token proximal offset, so a
one-position shift anywhere (model output, batching, loss) changes the numbers visibly.
"""

from __future__ import annotations

import math

import pytest
import torch

from splice_trainer_testlib import make_samples
from trainer_bridge.batching import make_micro_batches
from trainer_bridge.loss import decoupled_ppo_loss
from trainer_bridge.policy import Policy, load_causal_lm


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_causal_lm(str(tiny_model_dir))


def direct_logprobs(model, ids: list[int]) -> list[float]:
    """log pi(x_i | x_<i) for i >= 1 from the model's own full logits, one token at a time."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    out = [0.0]
    for i in range(1, len(ids)):
        out.append(torch.log_softmax(logits[i - 1], -1)[ids[i]].item())
    return out


def engine_like_samples(model):
    samples = make_samples(n_groups=2, group_size=2, seed=11, min_len=5, max_len=30)
    for k, s in enumerate(samples):
        exact = direct_logprobs(model, s["input_ids"])
        s["logprobs"] = [lp if m else 0.0 for lp, m in zip(exact, s["loss_mask"])]
        # distinct offset per token: pi_{v+1} differs from pi_v by a token-specific amount
        s["proximal_logprobs_t"] = [
            lp + 0.05 * ((i * 7 + k * 3) % 11 - 5) if m else 0.0 for i, (lp, m) in enumerate(zip(exact, s["loss_mask"]))
        ]
    return samples


def test_policy_logprobs_are_in_token_coordinates(model):
    policy = Policy(model, chunk_size=7)
    samples = make_samples(n_groups=2, group_size=2, seed=5, min_len=4, max_len=25)
    for mb in make_micro_batches(samples, [0.0] * len(samples), max_tokens=80):
        with torch.no_grad():
            lp, _ = policy(mb.input_ids, mb.attention_mask, mb.position_ids)
        for b, index in enumerate(mb.sample_indices):
            ids = samples[index]["input_ids"]
            expected = direct_logprobs(model, ids)
            assert lp[b, : len(ids)].tolist() == pytest.approx(expected, abs=1e-5)


def run_pipeline(model, samples, advantages, *, behav_weight, roll_old=False):
    """token_logprobs (via Policy) + batching + loss, exactly as the trainer wires them."""
    policy = Policy(model, chunk_size=16)
    n_total = sum(sum(s["loss_mask"]) for s in samples)
    loss_sum, kl_sum = 0.0, 0.0
    for mb in make_micro_batches(samples, advantages, max_tokens=64):
        with torch.no_grad():
            lp, _ = policy(mb.input_ids, mb.attention_mask, mb.position_ids)
        old = torch.roll(mb.logprobs, -1, dims=-1) if roll_old else mb.logprobs  # the seed's bug, on purpose
        loss, stats = decoupled_ppo_loss(
            logprobs=lp, proximal_logprobs=lp, old_logprobs=old, proximal_logprobs_t=mb.proximal_logprobs_t,
            advantages=mb.advantages, loss_mask=mb.loss_mask, behav_weight=behav_weight,
            behav_imp_weight_cap=None, behav_imp_weight_floor=None, loss_normalizer=n_total,
        )
        assert stats["ratio_min"] == stats["ratio_max"] == 1.0
        loss_sum += loss.item()
        kl_sum += stats["behav_kl_mean"] * stats["n_tokens"]
    return loss_sum, kl_sum / n_total


def test_pipeline_matches_direct_per_token_computation(model):
    samples = engine_like_samples(model)
    advantages = [1.0 + 0.5 * k for k in range(len(samples))]

    # segment-wise: w_i = exp(offset_i) -> loss = -sum(A * w) / n, computed token by token
    expected_loss, expected_kl, n = 0.0, 0.0, 0
    for s, a in zip(samples, advantages):
        for m, old, pt in zip(s["loss_mask"], s["logprobs"], s["proximal_logprobs_t"]):
            if m:
                expected_loss += -a * math.exp(pt - old)
                expected_kl += pt - old
                n += 1
    loss, kl = run_pipeline(model, samples, advantages, behav_weight="segment")
    assert loss == pytest.approx(expected_loss / n, abs=1e-6)
    assert kl == pytest.approx(expected_kl / n, abs=1e-6)

    # decoupled: the trainer's own logprob of token i against the engine's logprob of token i -> w == 1
    loss, kl = run_pipeline(model, samples, advantages, behav_weight="decoupled")
    assert abs(kl) < 1e-5
    assert loss == pytest.approx(-sum(a * sum(s["loss_mask"]) for s, a in zip(samples, advantages)) / n, abs=1e-4)


def test_a_one_position_shift_is_visible(model):
    """Control: the seed's misalignment (old_logprobs rolled by one) changes the result a lot."""
    samples = engine_like_samples(model)
    advantages = [1.0] * len(samples)
    _, kl_good = run_pipeline(model, samples, advantages, behav_weight="decoupled")
    _, kl_bad = run_pipeline(model, samples, advantages, behav_weight="decoupled", roll_old=True)
    assert abs(kl_good) < 1e-5 and abs(kl_bad) > 0.1


def test_trainer_sees_no_gap_to_engine_logprobs(model, tiny_model_dir, tmp_path):
    """Through the whole learner step (micro-batching, padding, proximal pass), the trainer's
    log-prob of each sampled token equals the engine's for that same token."""
    from trainer_bridge.config import TrainConfig
    from trainer_bridge.distributed import Dist
    from trainer_bridge.train import build_learner, learner_step

    samples = engine_like_samples(model)
    for s in samples:  # every sampled token from the weights the trainer holds (version 5)
        s["versions"] = [5 if m else -1 for m in s["loss_mask"]]
    cfg = TrainConfig(proxies=["unused"], model=str(tiny_model_dir), out=str(tmp_path), micro_batch_tokens=40, lr=0.0)
    learner = build_learner(cfg, Dist())
    stats = learner_step(learner, samples, [1.0] * len(samples), cfg, step=1, version=5)
    assert stats["engine_gap_tokens"] == sum(sum(s["loss_mask"]) for s in samples)
    assert stats["engine_gap_abs_max"] < 1e-5

    shifted = [dict(s, logprobs=s["logprobs"][1:] + [0.0]) for s in samples]  # the seed's off-by-one
    stats = learner_step(learner, shifted, [1.0] * len(samples), cfg, step=2, version=5)
    assert stats["engine_gap_abs_max"] > 0.5
