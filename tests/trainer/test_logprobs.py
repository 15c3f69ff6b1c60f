"""Chunked log-probs/entropy: equal to the naive path, token-coordinate aligned, bounded memory."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from trainer_bridge.logprobs import naive_token_logprobs_and_entropy, token_logprobs, token_logprobs_and_entropy

QWEN_VOCAB = 151936


def _inputs(tokens, hidden, vocab, seed=0, bias=False, lead=()):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*lead, tokens, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) * 0.3
    b = torch.randn(vocab, generator=g) if bias else None
    ids = torch.randint(0, vocab, (*lead, tokens), generator=g)
    return h, w, b, ids


def test_chunked_equals_naive_at_qwen_vocab(chunk=96):
    """Float32 chunked results within 1e-5 of the naive path computed exactly (float64).

    The naive float32 path itself is only good to a few 1e-5 over 152k logits (one big
    log_softmax accumulates more rounding than the chunked logsumexp), hence the looser check.
    """
    h, w, b, ids = _inputs(200, 64, QWEN_VOCAB, bias=True)  # 199 predictions: chunks of 96, 96, 7
    for temperature in (1.0, 0.7):
        lp, ent = token_logprobs_and_entropy(h, ids, w, b, temperature=temperature, chunk_size=chunk)
        exact_lp, exact_ent = naive_token_logprobs_and_entropy(h, ids, w, b, temperature=temperature, dtype=torch.float64)
        assert lp.shape == ent.shape == ids.shape and lp.dtype == ent.dtype == torch.float32
        torch.testing.assert_close(lp, exact_lp, atol=1e-5, rtol=0)
        torch.testing.assert_close(ent, exact_ent, atol=1e-5, rtol=0)
    f32_lp, f32_ent = naive_token_logprobs_and_entropy(h, ids, w, b, temperature=temperature)
    torch.testing.assert_close(lp, f32_lp, atol=1e-4, rtol=0)
    torch.testing.assert_close(ent, f32_ent, atol=2e-4, rtol=0)


def test_token_coordinates_by_explicit_loop():
    """out[0] == 0 and out[i] == log_softmax(logits at i-1)[x_i]: nothing rolled the wrong way."""
    h, w, _, ids = _inputs(12, 8, 50, seed=1)
    lp = token_logprobs(h, ids, w, chunk_size=5)
    assert lp[0].item() == 0.0
    for i in range(1, len(ids)):
        logits = (h[i - 1] @ w.T).double()
        expected = torch.log_softmax(logits, -1)[ids[i]].item()
        assert lp[i].item() == pytest.approx(expected, abs=1e-5)
        wrong = torch.log_softmax((h[i] @ w.T).double(), -1)[ids[i]].item() if i < len(ids) - 1 else None
        if wrong is not None:
            assert abs(lp[i].item() - wrong) > 1e-3  # the values make a one-position shift visible


def test_batched_rows_are_independent():
    h, w, _, ids = _inputs(10, 8, 40, seed=2, lead=(3,))
    lp, ent = token_logprobs_and_entropy(h, ids, w, chunk_size=7)
    for row in range(3):
        lp_row, ent_row = token_logprobs_and_entropy(h[row], ids[row], w, chunk_size=4)
        torch.testing.assert_close(lp[row], lp_row)
        torch.testing.assert_close(ent[row], ent_row)
    assert torch.all(lp[:, 0] == 0) and torch.all(ent[:, 0] == 0)


def test_mask_computes_only_selected_tokens():
    h, w, b, ids = _inputs(15, 8, 60, seed=7, bias=True, lead=(2,))
    mask = torch.rand(2, 15, generator=torch.Generator().manual_seed(1)) < 0.4
    coef = torch.randn(2, 15)
    results = []
    for m in (None, mask):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        lp, ent = token_logprobs_and_entropy(hh, ids, ww, b, chunk_size=4, mask=m)
        (lp * coef * mask).sum().backward()
        results.append((lp, ent, hh.grad, ww.grad))
    (lp_all, ent_all, gh_all, gw_all), (lp_m, ent_m, gh_m, gw_m) = results
    sel = mask.clone()
    sel[:, 0] = False  # nothing predicts token 0
    torch.testing.assert_close(lp_m[sel], lp_all[sel])
    torch.testing.assert_close(ent_m[sel], ent_all[sel])
    assert torch.all(lp_m[~sel] == 0) and torch.all(ent_m[~sel] == 0)
    torch.testing.assert_close(gh_m, gh_all)
    torch.testing.assert_close(gw_m, gw_all)


def test_gradients_equal_naive():
    h, w, b, ids = _inputs(70, 16, 3000, seed=3, bias=True)
    coef = torch.randn(70, generator=torch.Generator().manual_seed(4))
    grads = []
    for chunked in (True, False):
        hh, ww, bb = (t.clone().requires_grad_() for t in (h, w, b))
        if chunked:
            lp, _ = token_logprobs_and_entropy(hh, ids, ww, bb, temperature=0.8, chunk_size=16)
        else:
            lp, _ = naive_token_logprobs_and_entropy(hh, ids, ww, bb, temperature=0.8)
        (lp * coef).sum().backward()
        grads.append((hh.grad, ww.grad, bb.grad))
    for a, b_ in zip(*grads):
        torch.testing.assert_close(a, b_, atol=1e-5, rtol=1e-4)


def test_gradcheck_float64():
    h, w, b, ids = _inputs(9, 4, 11, seed=6, bias=True)
    h, w, b = (t.double().requires_grad_() for t in (h, w, b))

    def f(h, w, b):
        return token_logprobs(h, ids, w, b, temperature=0.9, chunk_size=3)

    assert torch.autograd.gradcheck(f, (h, w, b), eps=1e-6, atol=1e-6)


def test_edge_lengths():
    h, w, _, ids = _inputs(1, 4, 9)
    assert token_logprobs(h, ids, w).tolist() == [0.0]
    assert token_logprobs(h[:0], ids[:0], w).shape == (0,)
    with pytest.raises(ValueError):
        token_logprobs(h, ids[:, None], w)
    with pytest.raises(ValueError):
        token_logprobs(h, ids, w, temperature=0)


class PeakMemory(TorchDispatchMode):
    """Peak bytes of tensor storages created (and still alive) while active, including backward."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            storage = t.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if size == 0 or key in self.live:
                continue
            self.live[key] = size
            self.current += size
            self.peak = max(self.peak, self.current)
            self.largest = max(self.largest, size)
            weakref.finalize(storage, self._free, key)
        return out

    def _free(self, key):
        self.current -= self.live.pop(key, 0)


def _forward_backward(fn, tokens, hidden, chunk=None):
    h, w, _, ids = _inputs(tokens, hidden, QWEN_VOCAB, seed=5)
    h.requires_grad_()
    w.requires_grad_()
    with PeakMemory() as mem:
        lp, ent = fn(h, ids, w) if chunk is None else fn(h, ids, w, chunk_size=chunk)
        (lp.sum() + ent.sum()).backward()
        del lp, ent
    return mem


def test_peak_memory_is_bounded_by_the_chunk():
    """Forward + backward peak: a few [chunk, vocab] tensors, the same for 3x more tokens."""
    hidden, chunk = 16, 32
    chunk_logits = chunk * QWEN_VOCAB * 4
    weight_grad = QWEN_VOCAB * hidden * 4

    short = _forward_backward(token_logprobs_and_entropy, 128, hidden, chunk)
    long = _forward_backward(token_logprobs_and_entropy, 384, hidden, chunk)
    for mem in (short, long):
        assert mem.largest <= max(chunk_logits, weight_grad) * 1.01
        assert mem.peak <= 3 * chunk_logits + 2 * weight_grad
    assert long.peak - short.peak < 0.01 * chunk_logits  # grows only by [tokens, hidden]-sized tensors

    naive = _forward_backward(naive_token_logprobs_and_entropy, 384, hidden)
    assert naive.largest >= 383 * QWEN_VOCAB * 4  # the tracker does see a full logits tensor
    assert naive.peak > 8 * long.peak


def test_bf16_head_is_a_bf16_gemm_with_float32_normalizer():
    """bf16 hidden states and head (FSDP mixed precision): float32 log-probs close to the float64
    reference, gradients in bf16, and no float32 copy of the weight is needed."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 12, 32, generator=g).bfloat16()
    weight = (torch.randn(300, 32, generator=g) * 0.3).bfloat16()
    ids = torch.randint(0, 300, (2, 12), generator=g)
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    lp, ent = token_logprobs_and_entropy(h, ids, w, chunk_size=5)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    ref_lp, ref_ent = naive_token_logprobs_and_entropy(hidden.double(), ids, weight.double(), dtype=torch.float64)
    # the bf16 operands are exact in float64; only the GEMM's output rounding differs
    torch.testing.assert_close(lp, ref_lp, atol=3e-2, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=3e-2, rtol=0)
    lp.sum().backward()
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    hd, wd = hidden.double().requires_grad_(), weight.double().requires_grad_()
    naive = torch.log_softmax(hd[..., :-1, :] @ wd.T, -1).gather(-1, ids[..., 1:].unsqueeze(-1)).sum()
    naive.backward()
    torch.testing.assert_close(w.grad.double(), wd.grad, atol=5e-2, rtol=2e-2)
