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

All tensors share one shape and are in token coordinates (docs/design.md section 2): padded
``[rows, T]`` (each row one sample) or packed (``[T]`` or ``[1, T]`` with ``seq_ids`` saying which
sample each token belongs to).

Options for long off-policy agent samples:

* ``proximal_missing``: tokens whose ``pi_{v+1}`` was never recomputed fall back to the
  decoupled weight ``pi_prox / pi_behav`` (segment mode only; otherwise their weight would be 1);
* off-policy guards on the engine-trainer mismatch ``rho = pi_trainer / pi_engine`` under the
  *same* weights, known for tokens sampled by the weights the step starts from (``fresh``:
  ``rho = exp(prox - behav)``) and tokens whose ``pi_{v+1}`` the engine recomputed under those
  weights (``recomputed``: ``rho = exp(prox - prox_t)``); ``rho = 1`` elsewhere.
  ``tis_cap`` (truncated importance sampling): the mismatch factor of the behaviour weight is
  ``min(rho, cap)`` (segment / off modes multiply it in, the decoupled weight has its own ``rho``
  replaced); ``mis_band = (lo, hi)`` (masked importance sampling, IcePop-style): tokens with
  ``rho`` outside the band are not trained on. ``engine_gap_cap`` is the older name of
  ``tis_cap``;
* ``loss_agg``: how token terms become one number (see :data:`LOSS_AGGS`).

Statistics come back as tensors, so a training step needs no host sync for them;
:func:`stats_to_floats` turns them into Python numbers in one transfer.
"""

from __future__ import annotations

from typing import Literal

import torch

BehavWeight = Literal["segment", "decoupled", "off"]
LossAgg = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]

#: ``token-mean``: sum over tokens / number of loss tokens (the default; SPEC section 6).
#: ``seq-mean-token-sum``: mean over samples of each sample's token sum.
#: ``seq-mean-token-mean``: mean over samples of each sample's token mean (GRPO's original).
#: ``seq-mean-token-sum-norm``: mean over samples of token sum / ``loss_norm_tokens``, a constant
#: (Dr. GRPO: no length normalisation, so long samples are not down-weighted per token).
LOSS_AGGS: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

STAT_KEYS = (
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
    "missing_fallback_frac",
    "engine_gap_capped_frac",
    "tis_truncated_frac",
    "mis_masked_frac",
    "mismatch_known_frac",
)


def decoupled_ppo_loss(
    *,
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor | None = None,
    old_logprobs: torch.Tensor,
    proximal_logprobs_t: torch.Tensor | None = None,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    eps_clip: float = 0.2,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    behav_weight: BehavWeight = "segment",
    behav_imp_weight_cap: float | None = 5.0,
    behav_imp_weight_floor: float | None = 0.2,
    loss_normalizer: float | torch.Tensor | None = None,
    loss_agg: LossAgg = "token-mean",
    seq_ids: torch.Tensor | None = None,
    loss_norm_tokens: float | None = None,
    proximal_missing: torch.Tensor | None = None,
    fresh: torch.Tensor | None = None,
    engine_gap_cap: float | None = None,
    recomputed: torch.Tensor | None = None,
    tis_cap: float | None = None,
    mis_band: tuple[float, float] | None = None,
    staleness: torch.Tensor | None = None,
    staleness_buckets: int = 8,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Return ``(loss, stats)``; ``stats`` values are tensors (no host sync here).

    ``loss = sum(pg * w * mask_effective * agg)``, ``agg`` per :data:`LOSS_AGGS`. With gradient
    accumulation pass ``loss_normalizer`` = the whole minibatch's count (all micro-batches, all
    ranks) of what the aggregation divides by: loss tokens for ``token-mean``, samples with a loss
    token for the ``seq-mean-*`` modes; then the accumulated gradient is the minibatch's.
    Per-sample sums need every token of a sample in the same call (samples are never split).

    ``proximal_logprobs`` None: the PPO ratio is identically 1 (one minibatch per step), the
    proximal values are ``logprobs`` detached. ``proximal_logprobs_t`` is only needed by the
    ``segment`` weight. ``staleness`` (per token, ``version - versions``) adds per-staleness sums
    of the behaviour weight (``behav_imp_weight_sum_by_staleness``, ``tokens_by_staleness``;
    the last bucket holds everything older).

    Stats are over the tokens of ``loss_mask``; ``n_tokens`` says how many, so that callers can
    merge stats from several micro-batches (see :class:`StatsAccumulator`).
    """
    if proximal_logprobs is None:
        proximal_logprobs = logprobs.detach()
    if proximal_logprobs_t is None:
        if behav_weight == "segment":
            raise ValueError("behav_weight='segment' needs proximal_logprobs_t")
        proximal_logprobs_t = old_logprobs
    tensors = [logprobs, proximal_logprobs, old_logprobs, proximal_logprobs_t, advantages, loss_mask]
    tensors += [t for t in (seq_ids, proximal_missing, fresh, recomputed, staleness) if t is not None]
    shapes = {t.shape for t in tensors}
    if len(shapes) != 1:
        raise ValueError(f"all loss inputs must share one shape, got {sorted(map(tuple, shapes))}")
    if behav_weight not in ("segment", "decoupled", "off"):
        raise ValueError(f"behav_weight must be 'segment', 'decoupled' or 'off', got {behav_weight!r}")
    if c_clip is not None and c_clip <= 1.0:
        raise ValueError(f"c_clip must be > 1 for dual clip, got {c_clip}")
    if loss_agg not in LOSS_AGGS:
        raise ValueError(f"loss_agg must be one of {', '.join(LOSS_AGGS)}, got {loss_agg!r}")
    if loss_agg == "seq-mean-token-sum-norm" and not loss_norm_tokens:
        raise ValueError("loss_agg='seq-mean-token-sum-norm' needs loss_norm_tokens (the constant normaliser)")
    if engine_gap_cap is not None:
        if tis_cap is not None and tis_cap != engine_gap_cap:
            raise ValueError("engine_gap_cap is the older name of tis_cap: give one of them")
        tis_cap = engine_gap_cap
    if tis_cap is not None and tis_cap <= 0:
        raise ValueError(f"tis_cap must be > 0, got {tis_cap}")
    if mis_band is not None and not (0 <= mis_band[0] < 1 < mis_band[1]):
        raise ValueError(f"mis_band must be (lo, hi) with 0 <= lo < 1 < hi, got {mis_band}")
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
        prox64 = prox.to(torch.float64)
        no = torch.zeros_like(mask)
        fallback = mask & proximal_missing.bool() if (proximal_missing is not None and behav_weight == "segment") else no
        if behav_weight == "segment":
            behav_kl = torch.where(fallback, prox64 - old, proximal_logprobs_t.to(torch.float64) - old)
        elif behav_weight == "decoupled":
            behav_kl = prox64 - old
        else:
            behav_kl = torch.zeros_like(old)
        behav_kl = torch.where(mask, behav_kl, torch.zeros_like(behav_kl))
        w = torch.exp(behav_kl)
        # where the engine gave a log-prob under the weights the trainer holds: rho is known there
        fresh_m = mask & as_mask(fresh, mask)
        recomputed_m = mask & as_mask(recomputed, mask) & ~fresh_m
        known = fresh_m | recomputed_m
        prox_t64 = proximal_logprobs_t.to(torch.float64)
        zero = torch.zeros_like(old)
        mismatch = torch.where(fresh_m, prox64 - old, torch.where(recomputed_m, prox64 - prox_t64, zero))
        rho = torch.exp(mismatch)
        capped = no
        if tis_cap is not None:
            capped = known & (rho > tis_cap)
            own = rho if behav_weight == "decoupled" else torch.ones_like(rho)  # the rho already inside w
            w = torch.where(known, w / own * rho.clamp(max=tis_cap), w)
        keep = mask.clone()
        mis = no
        if mis_band is not None:
            mis = known & ((rho < mis_band[0]) | (rho > mis_band[1]))
            keep &= ~mis
        if behav_imp_weight_cap is not None:
            keep &= w <= behav_imp_weight_cap
        if behav_imp_weight_floor is not None:
            keep &= w >= behav_imp_weight_floor
        w_eff = torch.where(keep, w, torch.zeros_like(w)).to(logprobs.dtype)
        agg = _aggregation_weights(mask, loss_agg, seq_ids, loss_normalizer, loss_norm_tokens).to(logprobs.dtype)

    loss = (pg * w_eff * agg).sum()

    with torch.no_grad():
        stats = _token_stats(mask, ratio=ratio.detach(), w=w, behav_kl=behav_kl, clipped=clipped, dual=dual, keep=keep,
                             fallback=fallback, capped=capped, mis=mis, known=known)
        stats["loss"] = loss.detach()
        if staleness is not None:
            bucket = staleness.long().clamp(0, staleness_buckets - 1)
            m = mask.to(torch.float64)
            stats["behav_imp_weight_sum_by_staleness"] = torch.zeros(staleness_buckets, dtype=torch.float64, device=w.device).index_add_(
                0, bucket.reshape(-1), (w * m).reshape(-1))
            stats["tokens_by_staleness"] = torch.zeros(staleness_buckets, dtype=torch.float64, device=w.device).index_add_(
                0, bucket.reshape(-1), m.reshape(-1))
    return loss, stats


def _aggregation_weights(mask, loss_agg, seq_ids, loss_normalizer, loss_norm_tokens) -> torch.Tensor:
    """Per-token factor turning token terms into the aggregated loss (0 off the mask)."""
    m = mask.to(torch.float64)
    if loss_agg == "token-mean":
        denom = m.sum() if loss_normalizer is None else torch.as_tensor(loss_normalizer, dtype=torch.float64, device=m.device)
        return m / denom.clamp(min=1)
    if seq_ids is None:  # padded rows (or one packed sample): each row is a sample
        seq_ids = torch.arange(m.shape[0], device=m.device).unsqueeze(-1).expand_as(m) if m.dim() > 1 else torch.zeros_like(m, dtype=torch.long)
    ids = seq_ids.reshape(-1).long()
    valid = ids >= 0
    slot = torch.where(valid, ids, torch.zeros_like(ids))
    flat = m.reshape(-1) * valid
    per_seq = torch.zeros(ids.numel(), dtype=torch.float64, device=m.device).index_add_(0, slot, flat)  # loss tokens per sample
    if loss_normalizer is None:
        n_seqs = (per_seq > 0).sum().to(torch.float64)
    else:
        n_seqs = torch.as_tensor(loss_normalizer, dtype=torch.float64, device=m.device)
    n_seqs = n_seqs.clamp(min=1)
    if loss_agg == "seq-mean-token-sum":
        weight = flat / n_seqs
    elif loss_agg == "seq-mean-token-mean":
        weight = flat / (n_seqs * per_seq[slot].clamp(min=1))
    else:  # seq-mean-token-sum-norm
        weight = flat / (n_seqs * float(loss_norm_tokens))
    return weight.reshape(m.shape)


def as_mask(flags: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """``flags`` as a boolean mask (all False when not given)."""
    return torch.zeros_like(like, dtype=torch.bool) if flags is None else flags.bool()


def _token_stats(mask, *, ratio, w, behav_kl, clipped, dual, keep, fallback, capped, mis, known) -> dict[str, torch.Tensor]:
    """Means/fractions over loss-mask tokens, as 0-d tensors; zeros when there are none."""
    m = mask.to(torch.float64)
    n = m.sum()
    inv = 1.0 / n.clamp(min=1)
    has = n > 0

    def mean(x):
        return (x.to(torch.float64) * m).sum() * inv

    def std(x):
        x = x.to(torch.float64)
        return (((x - mean(x)) ** 2) * m).sum().mul(inv).sqrt()

    def extreme(x, fn, fill):
        x = torch.where(mask, x.to(torch.float64), torch.full_like(x, fill, dtype=torch.float64))
        return torch.where(has, fn(x), torch.zeros((), dtype=torch.float64, device=x.device))

    return {
        "n_tokens": mask.sum(),
        "clip_frac": mean(clipped),
        "dual_clip_frac": mean(dual),
        "masked_frac": torch.where(has, 1.0 - mean(keep), torch.zeros_like(n)),
        "behav_imp_weight_mean": mean(w),
        "behav_imp_weight_std": std(w),
        "behav_imp_weight_max": extreme(w, torch.max, float("-inf")),
        "behav_kl_mean": mean(behav_kl),
        "ratio_mean": mean(ratio),
        "ratio_std": std(ratio),
        "ratio_min": extreme(ratio, torch.min, float("inf")),
        "ratio_max": extreme(ratio, torch.max, float("-inf")),
        "missing_fallback_frac": mean(fallback),
        "engine_gap_capped_frac": mean(capped),
        "tis_truncated_frac": mean(capped),
        "mis_masked_frac": mean(mis),
        "mismatch_known_frac": mean(known),
    }


def stats_to_floats(stats: dict[str, torch.Tensor]) -> dict[str, float]:
    """Tensor stats as Python numbers, in one device-to-host transfer.

    Vector stats (per-staleness sums) become ``<key>_<i>`` entries; ``n_tokens`` an int.
    """
    keys, parts = [], []
    for k, v in stats.items():
        t = torch.as_tensor(v).detach().to(torch.float64).reshape(-1)
        keys.append((k, t.numel(), torch.as_tensor(v).dim()))
        parts.append(t.cpu() if t.device.type == "cpu" else t)
    if not parts:
        return {}
    values = torch.cat([p.to(parts[0].device) for p in parts]).tolist()
    out: dict[str, float] = {}
    i = 0
    for k, size, dim in keys:
        if dim == 0:
            out[k] = int(values[i]) if k == "n_tokens" else values[i]
        else:
            for j in range(size):
                out[f"{k}_{j}"] = values[i + j]
        i += size
    return out
