"""The agreement gate's counting, and token_mult_prob_error against its definition."""

from __future__ import annotations

import math

import pytest

from trainer_bridge.agreement import AgreementGate


def step(err, tokens=10):
    return {"token_mult_prob_error": err, "agreement_tokens": tokens if err is not None else 0,
            "agreement_abs_gap_mean": 0.3, "agreement_abs_gap_max": 1.2}


def test_trips_after_patience_steps_in_a_row():
    gate = AgreementGate(max_error=1.1, patience=3)
    seq = [1.5, 1.5, 1.0, 1.5, None, 1.5, 1.5]  # a good step resets; an unmeasured one does not
    tripped = []
    for err in seq:
        fields = gate.check(step(err))
        tripped.append(fields["agreement_stopped"])
    assert tripped == [False, False, False, False, False, False, True]
    assert "3 steps in a row" in gate.message(step(1.5)) and "worker-extension-cls" in gate.message(step(1.5))


def test_none_threshold_never_stops():
    gate = AgreementGate(max_error=None, patience=1)
    assert not any(gate.check(step(50.0))["agreement_stopped"] for _ in range(5))


def test_token_mult_prob_error_is_nemo_rls_definition(tiny_model_dir, tmp_path):
    """One real step on synthetic samples: the reported error equals mean(exp(|trainer - engine|))
    computed in float64 from the trainer's own log-probs of the same tokens."""
    import torch

    from splice_trainer_testlib import make_samples
    from trainer_bridge.config import TrainConfig
    from trainer_bridge.policy import load_causal_lm

    samples = make_samples(n_groups=1, group_size=2, seed=5, version=5)
    model = load_causal_lm(str(tiny_model_dir), dtype="float64").eval()
    errs = []
    for s in samples:
        ids = torch.tensor([s["input_ids"]])
        with torch.no_grad():
            lsm = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
        for i in range(1, len(s["input_ids"])):
            trainer = float(lsm[i - 1, s["input_ids"][i]])
            if s["loss_mask"][i] and s["versions"][i] == 5:  # sampled by the trainer's weights
                errs.append(math.exp(abs(trainer - s["logprobs"][i])))
            elif s["loss_mask"][i] and s["versions"][i] == 4 and s["proximal_versions"][i] == 5:  # recomputed under them
                errs.append(math.exp(abs(trainer - s["proximal_logprobs_t"][i])))
    from trainer_bridge.learner import build_learner, learner_step
    from trainer_bridge import distributed

    config = TrainConfig(proxies=["http://x"], model=str(tiny_model_dir), out=str(tmp_path), micro_batch_tokens=256,
                         lr=0.0, progress=False, tis_cap=None, mis_low=None, mis_high=None)
    dist = distributed.setup("cpu")
    try:
        learner = build_learner(config, dist)
        stats = learner_step(learner, samples, [1.0] * len(samples), config, 1, version=5)
    finally:
        distributed.teardown(dist)
    assert stats["agreement_tokens"] == len(errs) > 0
    assert stats["token_mult_prob_error"] == pytest.approx(sum(errs) / len(errs), rel=1e-5)
