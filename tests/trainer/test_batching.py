"""Micro-batches keep every per-token array in step; padding never counts."""

from __future__ import annotations

import pytest
import torch

from splice_trainer_testlib import make_samples
from trainer_bridge.batching import (
    TOKEN_FIELDS,
    empty_micro_batch,
    make_micro_batches,
    plan_micro_batches,
    validate_sample,
)


def test_every_array_stays_in_step_and_padding_is_masked():
    samples = make_samples(n_groups=3, group_size=3, seed=3, min_len=3, max_len=40)
    advantages = [0.1 * (i + 1) for i in range(len(samples))]
    batches = make_micro_batches(samples, advantages, max_tokens=100)
    seen = []
    for mb in batches:
        rows, width = mb.input_ids.shape
        assert rows * width <= 100 or rows == 1
        for name in ("attention_mask", "position_ids", "loss_mask", "logprobs", "versions",
                     "proximal_logprobs_t", "proximal_versions", "advantages"):
            assert getattr(mb, name).shape == (rows, width), name
        for b, index in enumerate(mb.sample_indices):
            s = samples[index]
            n = len(s["input_ids"])
            for key, (dtype, _) in TOKEN_FIELDS.items():
                assert getattr(mb, key)[b, :n].tolist() == torch.as_tensor(s[key], dtype=dtype).tolist(), key
            assert mb.attention_mask[b, :n].tolist() == [1] * n
            assert mb.position_ids[b, :n].tolist() == list(range(n))
            assert torch.all(mb.advantages[b, :n] == torch.tensor(advantages[index]))
            # padding: no attention, no loss, no version
            assert torch.all(mb.attention_mask[b, n:] == 0)
            assert torch.all(mb.loss_mask[b, n:] == 0)
            assert torch.all(mb.versions[b, n:] == -1)
            seen.append(index)
    assert sorted(seen) == list(range(len(samples)))


def test_plan_respects_budget_and_long_samples_ride_alone():
    lengths = [5, 50, 7, 200, 7, 30]
    groups = plan_micro_batches(lengths, max_tokens=60)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        longest = max(lengths[i] for i in g)
        assert len(g) * longest <= 60 or len(g) == 1
    assert [3] in groups  # 200 > budget: alone


def test_mismatched_lengths_are_rejected():
    s = make_samples(n_groups=1, group_size=1)[0]
    s = dict(s, proximal_logprobs_t=s["proximal_logprobs_t"][:-1])
    with pytest.raises(ValueError, match="proximal_logprobs_t"):
        validate_sample(s)
    with pytest.raises(ValueError, match="one advantage"):
        make_micro_batches([s], [], 10)


def test_empty_micro_batch_has_nothing_to_learn():
    mb = empty_micro_batch()
    assert mb.input_ids.shape == (1, 2) and mb.n_loss_tokens == 0 and mb.sample_indices == []
