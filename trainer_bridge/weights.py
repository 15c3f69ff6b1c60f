"""Splice's segment-wise behaviour weight for any trainer, in NumPy (no torch, no model).

The weight needs only two fields of a pulled sample: ``w = exp(proximal_logprobs_t - logprobs)``
(``pi_{v+1} / pi_v`` of the token's own version step, docs/design.md section 6), detached, with
tokens whose weight leaves ``[floor, cap]`` dropped from the loss. A PPO loss that takes
per-token importance weights (verl's ``rollout_is_weights``, prime-rl's ``loss_weights``,
AReaL's ``behave_imp_weight``) then reproduces ``trainer_bridge.loss.decoupled_ppo_loss``
in its default segment-wise mode; docs/samples.md shows the few lines each needs.
"""

from __future__ import annotations

import numpy as np


def behaviour_weights(
    logprobs: np.ndarray,
    proximal_logprobs_t: np.ndarray,
    cap: float | None = 5.0,
    floor: float | None = 0.2,
    loss_mask: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Return ``(weights, keep)`` for arrays of one shape (a sample, or packed samples).

    ``keep`` is True where the token is trained on: in ``loss_mask`` (all tokens when None) and
    with ``floor <= exp(proximal_logprobs_t - logprobs) <= cap`` (a None bound does not apply).
    ``weights`` (float64) is that ratio where ``keep`` and 0 elsewhere, so ``pg * weights``
    summed and divided by the loss-mask token count is Splice's loss. Computed in float64
    like the torch loss; prompt tokens (0.0 in both arrays) get ratio 1.
    """
    lp = np.asarray(logprobs, dtype=np.float64)
    prox = np.asarray(proximal_logprobs_t, dtype=np.float64)
    if lp.shape != prox.shape:
        raise ValueError(f"logprobs {lp.shape} and proximal_logprobs_t {prox.shape} must have one shape")
    mask = np.ones(lp.shape, dtype=bool) if loss_mask is None else np.asarray(loss_mask).astype(bool)
    if mask.shape != lp.shape:
        raise ValueError(f"loss_mask {mask.shape} must have the shape of logprobs {lp.shape}")
    w = np.exp(np.where(mask, prox - lp, 0.0))
    keep = mask.copy()
    if cap is not None:
        keep &= w <= cap
    if floor is not None:
        keep &= w >= floor
    return np.where(keep, w, 0.0), keep
