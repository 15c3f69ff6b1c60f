"""Per-token log-probs and entropies from final hidden states, without the full logits tensor.

With Qwen's ~152k vocabulary, ``[tokens, vocab]`` float32 logits are 600 kB per token: 8k
tokens would be 5 GB, plus as much again kept for backward. Here the LM head is applied to
``chunk_size`` tokens at a time by a small autograd function that saves only its inputs and the
log-normalizer, and recomputes the chunk's logits in backward, turning them in place into the
gradient ``g * (onehot - softmax)``. Peak extra memory is a few ``[chunk_size, vocab]`` float32
tensors, independent of sequence length, in forward and backward alike.

Alignment (docs/design.md section 2): results are in *token coordinates*. ``out[..., i]`` is
``log pi(x_i | x_<i)`` computed from the hidden state at position ``i - 1``; ``out[..., 0]`` is 0
(nothing predicts the first token). The shift happens here, once, so callers compare these
values index-for-index with the proxy's per-token arrays and never roll anything themselves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


_LOW = (torch.bfloat16, torch.float16)


def _logits(hidden, weight, bias, inv_temp, banned=None):
    """One chunk's logits in float32 (float64 if the inputs are), scaled by 1/temperature.

    bf16 hidden states and head (FSDP mixed precision on GPU): a bf16 GEMM with float32 output,
    never a float32 copy of the ``[vocab, hidden]`` weight; the log-sum-exp runs in float32.
    ``banned``: token ids whose logits are -inf (never sampled by the engines, so left out of
    the softmax exactly as the engines' logit bias leaves them out).
    """
    if hidden.dtype in _LOW and weight.dtype == hidden.dtype:
        logits = _low_precision_linear(hidden, weight)
        if bias is not None:
            logits = logits + bias.float()
    else:
        dt = torch.promote_types(hidden.dtype, torch.float32)
        logits = F.linear(hidden.to(dt), weight.to(dt), None if bias is None else bias.to(dt))
    if inv_temp != 1.0:
        logits.mul_(inv_temp)
    if banned is not None:
        logits.index_fill_(-1, banned, float("-inf"))
    return logits


def _low_precision_linear(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``hidden @ weight.T`` from bf16/fp16 operands into a float32 result (fp32 accumulate)."""
    try:
        return torch.mm(hidden, weight.t(), out_dtype=torch.float32)
    except (TypeError, RuntimeError, NotImplementedError):  # builds without out_dtype support
        return F.linear(hidden, weight).float()


class _ChunkLogprobs(torch.autograd.Function):
    """``(log p(target), entropy)`` for one chunk of positions; entropy is not differentiated."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, inv_temp, banned=None):
        logits = _logits(hidden, weight, bias, inv_temp, banned)
        lse = torch.logsumexp(logits, dim=-1)
        logp = logits.sub_(lse.unsqueeze(-1))  # in place: logits become log-probs
        picked = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        # sum(p * logp), not lse - sum(p * logits): no cancellation between two large numbers
        if banned is None:
            entropy = -logp.exp().mul_(logp).sum(-1)
        else:  # p = 0 where logp = -inf: their term is 0, not 0 * -inf
            entropy = -logp.exp().mul_(logp.clamp_min(torch.finfo(logp.dtype).min)).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.inv_temp = inv_temp
        ctx.banned = banned
        ctx.mark_non_differentiable(entropy)
        return picked, entropy

    @staticmethod
    def backward(ctx, grad_picked, _grad_entropy):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        g = grad_picked.to(lse.dtype).unsqueeze(-1)
        # d logp[t] / d logits = onehot(t) - softmax; built in the recomputed logits' buffer
        grad = _logits(hidden, weight, bias, ctx.inv_temp, ctx.banned).sub_(lse.unsqueeze(-1)).exp_().mul_(-g)
        grad.scatter_add_(-1, targets.unsqueeze(-1), g)
        if ctx.inv_temp != 1.0:
            grad.mul_(ctx.inv_temp)
        # low-precision head: bf16 GEMMs (grad cast down) instead of float32 copies of the weight
        dt = weight.dtype if weight.dtype in _LOW else grad.dtype
        g_low = grad.to(dt)
        grad_hidden = (g_low @ weight.to(dt)).to(hidden.dtype) if ctx.needs_input_grad[0] else None
        grad_weight = (g_low.T @ hidden.to(dt)).to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_bias = grad.sum(0).to(bias.dtype) if bias is not None and ctx.needs_input_grad[2] else None
        return grad_hidden, grad_weight, grad_bias, None, None, None


def _shifted(hidden: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten (predictor hidden state, predicted token) pairs: position i-1 predicts token i."""
    if hidden.shape[:-1] != input_ids.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} does not match input_ids {tuple(input_ids.shape)}")
    h = hidden[..., :-1, :].reshape(-1, hidden.shape[-1])
    t = input_ids[..., 1:].reshape(-1)
    return h, t


def _to_token_coords(values: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Put predictions for tokens 1..L-1 back at indices 1..L-1, with 0 at index 0."""
    lead = input_ids.shape[:-1]
    values = values.reshape(*lead, input_ids.shape[-1] - 1)
    return torch.cat([values.new_zeros(*lead, 1), values], dim=-1)


def token_logprobs_and_entropy(
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    mask: torch.Tensor | None = None,
    banned_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked ``(logprobs, entropy)`` in token coordinates, float32, shaped like ``input_ids``.

    ``hidden``: ``[..., L, H]`` final hidden states; ``weight``: ``[V, H]`` LM head; ``bias``: ``[V]``.
    Logits are divided by ``temperature`` (use the temperature the engine sampled at).
    ``mask`` (token coordinates, like ``input_ids``): compute only the tokens where it is set and
    leave 0 elsewhere. With the loss mask this skips prompt and padding tokens, usually most of
    them, and gives the same values on the tokens that are computed.
    Gradients flow into ``hidden``, ``weight`` and ``bias`` through the log-probs; entropy is
    a detached statistic. (Float64 inputs are computed in float64, for gradcheck.)
    ``banned_ids``: token ids left out of the softmax (logits -inf), as the engines ban them at
    sampling; a banned target gets -inf.
    """
    if temperature <= 0:
        raise ValueError("temperature must be > 0")
    if chunk_size < 1:
        raise ValueError("chunk_size must be >= 1")
    if input_ids.shape[-1] == 0:
        empty = hidden.new_zeros(input_ids.shape, dtype=torch.promote_types(hidden.dtype, torch.float32))
        return empty, empty
    h, targets = _shifted(hidden, input_ids)
    out_dtype = torch.promote_types(hidden.dtype, torch.float32)
    selected = None
    if mask is not None:
        if mask.shape != input_ids.shape:
            raise ValueError(f"mask {tuple(mask.shape)} does not match input_ids {tuple(input_ids.shape)}")
        selected = mask[..., 1:].reshape(-1).bool().nonzero().squeeze(-1)
        h, targets = h[selected], targets[selected]
    lps, ents = [], []
    for start in range(0, h.shape[0], chunk_size):
        chunk = slice(start, start + chunk_size)
        lp, ent = _ChunkLogprobs.apply(h[chunk], weight, bias, targets[chunk], 1.0 / temperature, banned_ids)
        lps.append(lp)
        ents.append(ent)
    lp = torch.cat(lps) if lps else h.new_zeros(0, dtype=out_dtype)
    ent = torch.cat(ents) if ents else h.new_zeros(0, dtype=out_dtype)
    if selected is not None:  # scatter back to every predicted position, 0 where not computed
        n = input_ids[..., 1:].numel()
        lp = lp.new_zeros(n).index_put((selected,), lp)
        ent = ent.new_zeros(n).index_put((selected,), ent)
    return _to_token_coords(lp, input_ids), _to_token_coords(ent, input_ids)


def token_logprobs(
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """Chunked log-probs in token coordinates: ``out[..., 0] = 0``, ``out[..., i] = log pi(x_i | x_<i)``."""
    lp, _ = token_logprobs_and_entropy(hidden, input_ids, weight, bias, temperature=temperature, chunk_size=chunk_size)
    return lp


def naive_token_logprobs_and_entropy(
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference path: materialize all logits at once, in ``dtype``. Same conventions, float32 results.

    For tests and small vocabularies; ``dtype=torch.float64`` gives a near-exact reference.
    """
    logits = F.linear(hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)) / temperature
    logp_all = torch.log_softmax(logits[..., :-1, :], dim=-1)
    lp = logp_all.gather(-1, input_ids[..., 1:].unsqueeze(-1)).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    zero = lp.new_zeros(*input_ids.shape[:-1], 1)
    return torch.cat([zero, lp], dim=-1).float(), torch.cat([zero, ent.detach()], dim=-1).float()
