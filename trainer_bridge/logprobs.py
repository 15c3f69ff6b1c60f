"""Per-token log-probs and entropies from final hidden states, without the full logits tensor.

With Qwen's ~152k vocabulary, ``[tokens, vocab]`` float32 logits are 600 kB per token: 8k
tokens would be 5 GB, plus as much again kept for backward. Here the LM head is applied to
``chunk_size`` tokens at a time and, when gradients are needed, each chunk runs under
``torch.utils.checkpoint`` so backward recomputes that chunk's logits instead of storing them.
Peak extra memory is a few ``[chunk_size, vocab]`` tensors, independent of sequence length.

Alignment (SPEC section 2): results are in *token coordinates*. ``out[..., i]`` is
``log pi(x_i | x_<i)`` computed from the hidden state at position ``i - 1``; ``out[..., 0]`` is 0
(nothing predicts the first token). The shift happens here, once, so callers compare these
values index-for-index with the proxy's per-token arrays and never roll anything themselves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def _chunk_logprobs_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor, inv_temp: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of ``targets`` and entropy for one chunk of positions (float32 math)."""
    logits = F.linear(hidden.float(), weight.float(), None if bias is None else bias.float())
    if inv_temp != 1.0:
        logits = logits * inv_temp
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():  # entropy is a statistic, never differentiated
        logp = logits - lse.unsqueeze(-1)  # sum(p * logp), not lse - sum(p * logits): no cancellation
        entropy = -(logp.exp() * logp).sum(-1)
    return picked - lse, entropy


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
    use_checkpoint: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked ``(logprobs, entropy)`` in token coordinates, both float32, shaped like ``input_ids``.

    ``hidden``: ``[..., L, H]`` final hidden states; ``weight``: ``[V, H]`` LM head; ``bias``: ``[V]``.
    Logits are divided by ``temperature`` (use the temperature the engine sampled at).
    ``use_checkpoint`` defaults to "whenever autograd is recording".
    Entropy is returned detached.
    """
    if temperature <= 0:
        raise ValueError("temperature must be > 0")
    if chunk_size < 1:
        raise ValueError("chunk_size must be >= 1")
    if input_ids.shape[-1] == 0:
        empty = hidden.new_zeros(input_ids.shape, dtype=torch.float32)
        return empty, empty
    h, targets = _shifted(hidden, input_ids)
    inv_temp = 1.0 / temperature
    grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    if use_checkpoint is None:
        use_checkpoint = grad
    lps, ents = [], []
    for start in range(0, h.shape[0], chunk_size):
        hc, tc = h[start : start + chunk_size], targets[start : start + chunk_size]
        if use_checkpoint and grad:
            lp, ent = checkpoint(_chunk_logprobs_entropy, hc, weight, bias, tc, inv_temp, use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs_entropy(hc, weight, bias, tc, inv_temp)
        lps.append(lp)
        ents.append(ent)
    lp = torch.cat(lps) if lps else h.new_zeros(0, dtype=torch.float32)
    ent = torch.cat(ents) if ents else h.new_zeros(0, dtype=torch.float32)
    return _to_token_coords(lp, input_ids), _to_token_coords(ent.detach(), input_ids)


def token_logprobs(
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    use_checkpoint: bool | None = None,
) -> torch.Tensor:
    """Chunked log-probs in token coordinates: ``out[..., 0] = 0``, ``out[..., i] = log pi(x_i | x_<i)``."""
    lp, _ = token_logprobs_and_entropy(
        hidden, input_ids, weight, bias, temperature=temperature, chunk_size=chunk_size, use_checkpoint=use_checkpoint
    )
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
