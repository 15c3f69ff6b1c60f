"""GRPO advantages: each session's reward relative to the other sessions of its group.

The unit is the *session*, not the sample: one session can yield several samples (a fork starts
a new one, docs/design.md section 5), and all of them carry the session's reward. Normalizing over samples
would let a session that forked often pull the group baseline towards itself, so the group
statistics are taken over distinct sessions and every sample gets its session's advantage.

Samples without a ``group_id`` are pooled into one batch-level group, so their baseline is the
batch mean (a group of one would always get advantage 0).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

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


def token_advantages(advantage: float, length: int) -> torch.Tensor:
    """Broadcast a sample's advantage to each of its tokens (the loss mask selects which count)."""
    return torch.full((length,), float(advantage), dtype=torch.float32)
