"""``--max-staleness K`` at the source: a pull never hands out a sample holding loss tokens
sampled by a version older than ``current - K`` (docs/design.md section 4). Such samples are
dropped from the pool (their session is acked when nothing of it is left to hand out), counted,
and their owed proximal values are never recomputed."""

from __future__ import annotations


class StaleFilter:
    """``keep(sample)`` for ``TrainingPool.pull``; counts what it drops."""

    def __init__(self, min_version: int | None):
        self.min_version = min_version
        self.dropped = 0

    def keep(self, sample: dict) -> bool:
        if self.min_version is None:
            return True
        mv = self.min_version
        stale = any(m and v < mv for m, v in zip(sample["loss_mask"], sample["versions"]))
        if stale:
            self.dropped += 1
        return not stale
