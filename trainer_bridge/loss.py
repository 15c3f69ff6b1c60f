"""Decoupled PPO loss, with the segment-wise behaviour weight (docs/design.md section 6).

Two policies sit between the sampler and the learner:

* the *proximal* policy ``logp_prox`` is the trainer's own forward pass with the weights at the
  start of the step. The PPO trust region (ratio + clip) is taken against it, so the ratio on the
  first minibatch of a step is exactly 1;
* the *behaviour* policy ``logp_behav`` is what the engine actually sampled from. The gap between
  behaviour and proximal is corrected by a detached importance weight ``w``.

Segment-wise decoupled PPO replaces ``pi_prox / pi_behav`` in ``w`` by ``pi_{v+1} / pi_v``: the
one-version step after the weights that sampled the token (``proximal_logprobs_t``, filled in by
the proxy). That weight has far lower variance than the multi-version ``pi_prox / pi_behav``.
``proximal_logprobs_t`` only ever enters ``w``; the PPO ratio never sees it.

All tensors share one shape and are in token coordinates (docs/design.md section 2).
"""

from __future__ import annotations

from typing import Literal

import torch

BehavWeight = Literal["segment", "decoupled", "off"]


def decoupled_ppo_loss(
    *,
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    proximal_logprobs_t: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    eps_clip: float = 0.2,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    behav_weight: BehavWeight = "segment",
    behav_imp_weight_cap: float | None = 5.0,
    behav_imp_weight_floor: float | None = 0.2,
    loss_normalizer: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Return ``(loss, stats)``.

    ``loss = sum(pg * w * mask_effective) / sum(loss_mask)``: a global token mean. With gradient
    accumulation pass ``loss_normalizer`` = the loss-mask token count of the whole minibatch
    (all micro-batches, all ranks) so that the accumulated gradient is that same mean.

    Stats are over the tokens of ``loss_mask``; ``n_tokens`` says how many, so that callers can
    merge stats from several micro-batches (see :class:`StatsAccumulator`).
    """
    shapes = {t.shape for t in (logprobs, proximal_logprobs, old_logprobs, proximal_logprobs_t, advantages, loss_mask)}
    if len(shapes) != 1:
        raise ValueError(f"all loss inputs must share one shape, got {sorted(map(tuple, shapes))}")
    if behav_weight not in ("segment", "decoupled", "off"):
        raise ValueError(f"behav_weight must be 'segment', 'decoupled' or 'off', got {behav_weight!r}")
    if c_clip is not None and c_clip <= 1.0:
        raise ValueError(f"c_clip must be > 1 for dual clip, got {c_clip}")
    eps_hi = eps_clip if eps_clip_higher is None else eps_clip_higher

    mask = loss_mask.bool()
    adv = advantages.detach().to(logprobs.dtype)
    prox = proximal_logprobs.detach().to(logprobs.dtype)

    # PPO ratio against the proximal policy. Off-mask positions get log-ratio 0 so garbage there
    # (padding) can never overflow into inf/nan, not even through the gradient.
    log_ratio = torch.where(mask, logprobs - prox, torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_hi)
    pg = torch.maximum(pg_unclipped, pg_clipped)
    clipped = pg_clipped > pg_unclipped
    if c_clip is not None:
        dual_cap = c_clip * adv.abs()
        dual = (adv < 0) & (pg > dual_cap)
        pg = torch.where(dual, dual_cap, pg)
    else:
        dual = torch.zeros_like(mask)

    # Behaviour importance weight: detached, per token, then capped/floored by masking.
    with torch.no_grad():
        old = old_logprobs.to(torch.float64)
        if behav_weight == "segment":
            behav_kl = proximal_logprobs_t.to(torch.float64) - old
        elif behav_weight == "decoupled":
            behav_kl = prox.to(torch.float64) - old
        else:
            behav_kl = torch.zeros_like(old)
        behav_kl = torch.where(mask, behav_kl, torch.zeros_like(behav_kl))
        w = torch.exp(behav_kl)
        keep = mask.clone()
        if behav_imp_weight_cap is not None:
            keep &= w <= behav_imp_weight_cap
        if behav_imp_weight_floor is not None:
            keep &= w >= behav_imp_weight_floor
        w_eff = torch.where(keep, w, torch.zeros_like(w)).to(logprobs.dtype)

    n_tokens = mask.sum()
    if loss_normalizer is None:
        denom = n_tokens.clamp(min=1).to(logprobs.dtype)
    else:
        denom = torch.as_tensor(loss_normalizer, dtype=logprobs.dtype, device=logprobs.device).clamp(min=1)
    loss = (pg * w_eff).sum() / denom

    with torch.no_grad():
        n = int(n_tokens.item())
        stats = {"loss": float(loss.item()), "n_tokens": n}
        stats.update(_token_stats(mask, n, ratio=ratio, w=w, behav_kl=behav_kl, clipped=clipped, dual=dual, keep=keep))
    return loss, stats


def _token_stats(mask, n, *, ratio, w, behav_kl, clipped, dual, keep) -> dict[str, float]:
    """Means/fractions over loss-mask tokens; zeros when there are none."""
    if n == 0:
        zero = dict.fromkeys(
            [
                "clip_frac",
                "dual_clip_frac",
                "masked_frac",
                "behav_imp_weight_mean",
                "behav_imp_weight_std",
                "behav_imp_weight_max",
                "behav_kl_mean",
                "ratio_mean",
                "ratio_std",
                "ratio_min",
                "ratio_max",
            ],
            0.0,
        )
        return zero
    wm = w[mask].to(torch.float64)
    rm = ratio.detach()[mask].to(torch.float64)
    return {
        "clip_frac": clipped[mask].double().mean().item(),
        "dual_clip_frac": dual[mask].double().mean().item(),
        "masked_frac": 1.0 - keep[mask].double().mean().item(),
        "behav_imp_weight_mean": wm.mean().item(),
        "behav_imp_weight_std": wm.std(unbiased=False).item(),
        "behav_imp_weight_max": wm.max().item(),
        "behav_kl_mean": behav_kl[mask].mean().item(),
        "ratio_mean": rm.mean().item(),
        "ratio_std": rm.std(unbiased=False).item(),
        "ratio_min": rm.min().item(),
        "ratio_max": rm.max().item(),
    }
