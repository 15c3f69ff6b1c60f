"""Packed micro-batches: the layout, and log-probs/gradients equal to running each sample alone.

The reference runs every sample by itself through the plain transformers model (its own logits,
log-softmax in float64), so nothing of the packed path is reused to check it.
"""

from __future__ import annotations

import random

import pytest
import torch

from splice_trainer_testlib import make_samples
from trainer_bridge.batching import TOKEN_FIELDS, pack_micro_batches, plan_packs
from trainer_bridge.policy import Policy, load_causal_lm


def test_pack_layout_keeps_every_array_in_step():
    samples = make_samples(n_groups=3, group_size=3, seed=3, min_len=3, max_len=40)
    advantages = [0.1 * (i + 1) for i in range(len(samples))]
    seen = []
    for mb in pack_micro_batches(samples, advantages, max_tokens=64):
        assert mb.input_ids.shape[0] == 1 and mb.attention_mask is None
        assert mb.input_ids.shape[1] <= 64 or len(mb.sample_indices) == 1
        offset = 0
        for b, index in enumerate(mb.sample_indices):
            s = samples[index]
            n = len(s["input_ids"])
            span = slice(offset, offset + n)
            for key, (dtype, _) in TOKEN_FIELDS.items():
                assert getattr(mb, key)[0, span].tolist() == torch.as_tensor(s[key], dtype=dtype).tolist(), key
            assert mb.position_ids[0, span].tolist() == list(range(n))  # restart per sample
            assert mb.seq_ids[0, span].tolist() == [b] * n
            assert torch.all(mb.advantages[0, span] == torch.tensor(advantages[index]))
            offset += n
            seen.append(index)
        assert offset == mb.input_ids.shape[1]  # no padding
    assert sorted(seen) == list(range(len(samples)))


def test_rows_as_wide_as_the_longest_sample():
    samples = make_samples(n_groups=3, group_size=3, seed=4, min_len=3, max_len=40)
    (mb,) = pack_micro_batches(samples, [1.0] * len(samples), max_tokens=10_000, rows="longest")
    width = max(len(s["input_ids"]) for s in samples)
    assert mb.input_ids.shape[1] == width and mb.input_ids.shape[0] > 1
    real = mb.seq_ids >= 0
    assert int(real.sum()) == sum(len(s["input_ids"]) for s in samples)
    assert not mb.loss_mask[~real].any() and (mb.versions[~real] == -1).all()
    for b, index in enumerate(mb.sample_indices):  # each sample whole, in one row, positions from 0
        where = (mb.seq_ids == b).nonzero()
        assert where[:, 0].unique().numel() == 1
        r = int(where[0, 0])
        cols = where[:, 1]
        assert mb.input_ids[r, cols].tolist() == samples[index]["input_ids"]
        assert mb.position_ids[r, cols].tolist() == list(range(len(samples[index]["input_ids"])))


def test_plan_packs_fills_bins_first_fit():
    lengths = [5, 50, 7, 200, 7, 30, 12]
    groups = plan_packs(lengths, max_tokens=60)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert [3] in groups  # longer than the budget: alone
    assert all(sum(lengths[i] for i in g) <= 60 for g in groups if g != [3])
    assert groups == [[3], [1, 2], [5, 6, 4, 0]]  # first-fit decreasing: 200 | 50+7 | 30+12+7+5
    assert sum(lengths[i] for g in groups for i in g) == sum(lengths)


def _alone_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log pi(x_i | x_<i) of one sample run alone, from the model's own logits (float64 softmax)."""
    logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)
    return torch.cat([lp.new_zeros(1), lp])


@pytest.mark.parametrize("attn,rows", [("sdpa", "one"), ("eager", "one"), ("sdpa", "longest")])
def test_packed_logprobs_and_gradients_equal_unpacked(tiny_model_dir, attn, rows):
    samples = make_samples(n_groups=2, group_size=2, seed=5, min_len=4, max_len=30)
    rng = random.Random(0)
    coef = [[rng.uniform(-1, 1) for _ in s["input_ids"]] for s in samples]  # a loss: sum_i c_i * logp_i

    # reference: each sample alone through the plain model
    ref_model = load_causal_lm(str(tiny_model_dir), attn_implementation=attn)
    ref_lp = []
    for s, c in zip(samples, coef):
        lp = _alone_logprobs(ref_model, s["input_ids"])
        mask = torch.tensor(s["loss_mask"], dtype=torch.float64)
        (lp * mask * torch.tensor(c, dtype=torch.float64)).sum().backward()
        ref_lp.append(lp.detach())
    ref_grads = {n: p.grad.clone() for n, p in ref_model.named_parameters()}

    # packed: the policy on micro-batches of several samples each
    model = load_causal_lm(str(tiny_model_dir), attn_implementation=attn)
    policy = Policy(model, chunk_size=7)
    micro = pack_micro_batches(samples, [0.0] * len(samples), max_tokens=48, rows=rows)
    assert any(len(m.sample_indices) > 1 for m in micro)  # really packed
    for m in micro:
        lp, _ = policy(m.input_ids, None, m.position_ids, m.loss_mask)
        c = torch.zeros_like(lp)
        for b, i in enumerate(m.sample_indices):
            c[m.seq_ids == b] = torch.tensor(coef[i], dtype=c.dtype)
        (lp * m.loss_mask * c).sum().backward()
        for b, i in enumerate(m.sample_indices):
            mask = torch.tensor(samples[i]["loss_mask"], dtype=torch.bool)
            got = lp[m.seq_ids == b].double()
            torch.testing.assert_close(got[mask], ref_lp[i][mask], atol=2e-5, rtol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.double(), ref_grads[name].double(), atol=2e-5, rtol=1e-4, msg=name)


def test_auto_layout_picks_the_cheaper_rows():
    from trainer_bridge.batching import pack_rows

    many_short = [40] * 20
    assert pack_rows(many_short, "auto", attn_weight=0.01)[1] == 40  # 20 rows of 40, not one row of 800
    one_long = [4000, 100, 50]
    assert pack_rows(one_long, "auto", attn_weight=1e-4) == ([[0, 1, 2]], 4150)  # one row, no padding
    assert pack_rows(many_short, "auto", attn_weight=0.0) == ([list(range(20))], 800)  # attention free: no padding
