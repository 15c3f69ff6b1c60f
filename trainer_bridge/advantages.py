"""GRPO advantages: each episode's reward relative to the other episodes of its group.

The unit is the *episode* (one session), not the sample: one episode can yield several samples
(its main conversation, a sub-agent's, the continuation after a compaction, a fork; docs/samples.md,
"Episode roles"), and all of them carry the episode's reward. Normalizing over samples would let
an episode with many samples pull the group baseline towards itself, so the group statistics are
taken over distinct episodes and every sample gets its episode's advantage.

How much each sample then weighs in the loss is ``episode_loss_weights`` (``token``: every loss
token once, the plain token mean; ``episode``: every episode once; ``sample``: every sample once).

Samples without a ``group_id`` are pooled into one batch-level group, so their baseline is the
batch mean (a group of one would always get advantage 0).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

_UNGROUPED = object()


def group_advantages(
    samples: Sequence[dict[str, Any]], *, normalize_std: bool = True, eps: float = 1e-6
) -> list[float]:
    """One advantage per sample: ``(R_session - mean_group) / (std_group + eps)``.

    ``std`` is the population std over the group's sessions (``normalize_std=False`` skips the
    division, leaving mean-centred rewards).
    """
    session_reward: dict[Any, float] = {}
    group_sessions: dict[Any, list[Any]] = {}
    for s in samples:
        sid = s["session_id"]
        reward = float(s["reward"])
        if sid in session_reward:
            if not math.isclose(session_reward[sid], reward, rel_tol=0, abs_tol=1e-9):
                warnings.warn(
                    f"session {sid!r} has samples with different rewards "
                    f"({session_reward[sid]} and {reward}); using the first",
                    stacklevel=2,
                )
            continue
        session_reward[sid] = reward
        gid = s.get("group_id")
        group_sessions.setdefault(_UNGROUPED if gid is None else gid, []).append(sid)

    session_adv: dict[Any, float] = {}
    for sids in group_sessions.values():
        rewards = [session_reward[sid] for sid in sids]
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
        for sid, r in zip(sids, rewards):
            a = r - mean
            session_adv[sid] = a / (std + eps) if normalize_std else a
    return [session_adv[s["session_id"]] for s in samples]


LOSS_AGGREGATIONS = ("token", "episode", "sample")


def episode_loss_weights(samples: Sequence[dict[str, Any]], mode: str = "token") -> list[float]:
    """One weight per sample, to multiply its per-token loss terms before the batch's token mean.

    With ``T`` loss tokens in the batch (``loss_mask`` 1), ``E`` episodes and ``S`` samples, a
    sample of episode ``e`` holding ``T_e`` of them (``T_s`` its own) gets

    - ``token``: 1 (every loss token counts once: an episode weighs by its token count);
    - ``episode``: ``T / (E * T_e)`` (the loss is the mean over episodes of each episode's token
      mean: an episode of three samples weighs what an episode of one does);
    - ``sample``: ``T / (S * T_s)`` (the mean over samples of each sample's token mean).

    The weighted token mean then equals the stated mean; a sample with no loss token gets 0.
    """
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"loss aggregation must be one of {LOSS_AGGREGATIONS}, got {mode!r}")
    tokens = [int(np.count_nonzero(np.asarray(s["loss_mask"]))) for s in samples]
    if mode == "token":
        return [1.0 if t else 0.0 for t in tokens]
    total = sum(tokens)
    if mode == "sample":
        n = sum(1 for t in tokens if t)
        return [total / (n * t) if t else 0.0 for t in tokens]
    per_episode: dict[Any, int] = {}
    for s, t in zip(samples, tokens):
        per_episode[s["session_id"]] = per_episode.get(s["session_id"], 0) + t
    n = sum(1 for t in per_episode.values() if t)
    return [total / (n * per_episode[s["session_id"]]) if t else 0.0 for s, t in zip(samples, tokens)]


def token_advantages(advantage: float, length: int) -> torch.Tensor:
    """Broadcast a sample's advantage to each of its tokens (the loss mask selects which count)."""
    return torch.full((length,), float(advantage), dtype=torch.float32)
