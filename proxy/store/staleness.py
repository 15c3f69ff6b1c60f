"""``--max-staleness K`` at the source: a pull never hands out a sample holding loss tokens
sampled by a version older than ``current - K`` (docs/design.md section 4). Such samples are
dropped from the pool (their session is acked when nothing of it is left to hand out), counted,
and their owed proximal values are never recomputed."""

from __future__ import annotations

from typing import Any

import numpy as np


def is_stale(sample: Any, min_version: int | None) -> bool:
    """Whether ``sample`` (a ``Sample`` or its dict) holds a loss token older than ``min_version``."""
    if min_version is None:
        return False
    get = sample.get if isinstance(sample, dict) else lambda k: getattr(sample, k)
    mask = np.asarray(get("loss_mask"))
    versions = np.asarray(get("versions"))
    return bool(np.any((mask != 0) & (versions < min_version)))


class StaleFilter:
    """``keep(sample)`` for ``TrainingPool.lease`` / ``pull``; counts what it drops."""

    def __init__(self, min_version: int | None):
        self.min_version = min_version
        self.dropped = 0

    def keep(self, sample: Any) -> bool:
        stale = is_stale(sample, self.min_version)
        self.dropped += stale
        return not stale
