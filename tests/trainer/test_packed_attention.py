"""Packed attention without a dense mask (``trainer_bridge.attention``) equals per-sample attention.

Kernel level: against a float64 softmax written out here, one sample at a time. Model level: the
policy on packed rows against each sample run alone through the plain transformers model with
eager attention (its own logits, float64 log-softmax), log-probs and gradients.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from splice_trainer_testlib import make_samples
from trainer_bridge import attention
from trainer_bridge.batching import pack_micro_batches
from trainer_bridge.policy import Policy, load_causal_lm


def _positions(lengths: list[int], width: int | None = None) -> torch.Tensor:
    parts = [torch.arange(n) for n in lengths]
    used = sum(lengths)
    if width is not None and width > used:
        parts.append(torch.arange(width - used))  # row-end padding: a sequence of its own
    return torch.cat(parts)


def _reference(q, k, v, rows_lengths: list[list[int]]):
    """float64 softmax(q k^T / sqrt(d)) v, causal, one sample at a time, KV heads shared by groups."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    out = torch.zeros_like(q)
    for r, lengths in enumerate(rows_lengths):
        start = 0
        for n in lengths + [q.shape[2] - sum(lengths)]:
            if n == 0:
                continue
            s = slice(start, start + n)
            scores = q[r, :, s] @ k[r, :, s].transpose(-1, -2) / q.shape[-1] ** 0.5
            scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            out[r, :, s] = torch.softmax(scores, -1) @ v[r, :, s]
            start += n
    return out


ROWS = [[5, 17, 1, 9], [30, 2]]  # two rows of width 35: the first padded by 3, the second by 3


def _inputs(seed: int = 0):
    torch.manual_seed(seed)
    width = 35
    pos = torch.stack([_positions(lengths, width) for lengths in ROWS])
    q = torch.randn(2, 4, width, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, width, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, width, 8, dtype=torch.float64, requires_grad=True)
    return pos, q, k, v


def test_layout_from_positions():
    pos, *_ = _inputs()
    layout = attention.packed_layout(pos)
    assert layout.spans == [(0, 0, 5), (0, 5, 22), (0, 22, 23), (0, 23, 32), (0, 32, 35),
                            (1, 0, 30), (1, 30, 32), (1, 32, 35)]
    assert layout.cu_seqlens.tolist() == [0, 5, 22, 23, 32, 35, 65, 67, 70]
    assert layout.max_len == 30
    assert layout.doc_ids[1].tolist() == [5] * 30 + [6] * 2 + [7] * 3


def test_per_sample_sdpa_equals_reference_with_gradients():
    pos, q, k, v = _inputs()
    layout = attention.packed_layout(pos)
    ref = _reference(q, k, v, ROWS)
    w = torch.randn_like(ref)
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    got = attention.per_sample_sdpa(q, k, v, layout, None)
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=0)
    for g, r in zip(torch.autograd.grad((got * w).sum(), (q, k, v)), ref_grads):
        torch.testing.assert_close(g, r, atol=1e-12, rtol=0)


def test_flex_document_mask_equals_reference():
    """FlexAttention's block mask (eager on CPU: forward only, float32)."""
    pos, q, k, v = _inputs(1)
    layout = attention.packed_layout(pos, attention.FLEX)
    assert layout.block_mask is not None
    with torch.no_grad():
        got = attention.flex_attention(q.float(), k.float(), v.float(), layout, None, compiled=False)
        ref = _reference(q, k, v, ROWS)
    torch.testing.assert_close(got.double(), ref, atol=2e-6, rtol=0)


def test_a_dense_mask_differs():
    """The reference really separates samples: attention over the whole row gives another result."""
    pos, q, k, v = _inputs()
    with torch.no_grad():
        whole = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
        assert (whole - _reference(q, k, v, ROWS)).abs().max() > 1e-2


def _alone_logprobs(model, ids):
    logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)
    return torch.cat([lp.new_zeros(1), lp])


@pytest.mark.parametrize("rows", ["one", "longest"])
def test_policy_on_packed_rows_equals_each_sample_alone(tiny_model_dir, rows, monkeypatch):
    samples = make_samples(n_groups=2, group_size=2, seed=7, min_len=4, max_len=30)
    rng = random.Random(1)
    coef = [[rng.uniform(-1, 1) for _ in s["input_ids"]] for s in samples]

    ref_model = load_causal_lm(str(tiny_model_dir), attn_implementation="eager")
    ref_lp = []
    for s, c in zip(samples, coef):
        lp = _alone_logprobs(ref_model, s["input_ids"])
        (lp * torch.tensor(s["loss_mask"], dtype=torch.float64) * torch.tensor(c, dtype=torch.float64)).sum().backward()
        ref_lp.append(lp.detach())
    ref_grads = {n: p.grad.clone() for n, p in ref_model.named_parameters()}

    model = load_causal_lm(str(tiny_model_dir), attn_implementation=attention.SDPA)
    assert model.config._attn_implementation == attention.SDPA
    policy = Policy(model, chunk_size=7)
    masks = []
    real_sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):  # no attention call ever gets a mask
        masks.append(kwargs.get("attn_mask", args[3] if len(args) > 3 else None))
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    micro = pack_micro_batches(samples, [0.0] * len(samples), max_tokens=48, rows=rows)
    assert any(len(m.sample_indices) > 1 for m in micro)
    for m in micro:
        lp, _ = policy(m.input_ids, None, m.position_ids, m.loss_mask)
        c = torch.zeros_like(lp)
        for b, i in enumerate(m.sample_indices):
            c[m.seq_ids == b] = torch.tensor(coef[i], dtype=c.dtype)
        (lp * m.loss_mask * c).sum().backward()
        for b, i in enumerate(m.sample_indices):
            mask = torch.tensor(samples[i]["loss_mask"], dtype=torch.bool)
            torch.testing.assert_close(lp[m.seq_ids == b].double()[mask], ref_lp[i][mask], atol=2e-5, rtol=0)
    assert masks and all(x is None for x in masks)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.double(), ref_grads[name].double(), atol=2e-5, rtol=1e-4, msg=name)


def test_auto_picks_a_packed_implementation_on_cpu():
    assert attention.pick("auto", torch.device("cpu")) == attention.SDPA
    assert attention.pick("sdpa", torch.device("cpu")) == "sdpa"


def test_right_padded_rows_equal_each_sample_alone(tiny_model_dir):
    """The padded layout (one right-padded row per sample, an attention mask) through a packed implementation."""
    from trainer_bridge.batching import make_micro_batches

    samples = make_samples(n_groups=2, group_size=2, seed=9, min_len=4, max_len=20)
    ref_model = load_causal_lm(str(tiny_model_dir), attn_implementation="eager")
    policy = Policy(load_causal_lm(str(tiny_model_dir), attn_implementation=attention.SDPA), chunk_size=5)
    for mb in make_micro_batches(samples, [0.0] * len(samples), max_tokens=80):
        assert mb.attention_mask is not None and not mb.attention_mask.bool().all()  # really padded
        with torch.no_grad():
            lp, _ = policy(mb.input_ids, mb.attention_mask, mb.position_ids)
            for b, i in enumerate(mb.sample_indices):
                ids = samples[i]["input_ids"]
                torch.testing.assert_close(lp[b, : len(ids)].double(), _alone_logprobs(ref_model, ids), atol=2e-5, rtol=0)
    left = torch.tensor([[0, 1, 1]])
    with pytest.raises(ValueError, match="right-padded"):
        policy(torch.tensor([[1, 2, 3]]), left, torch.tensor([[0, 0, 1]]))
