"""R2 (docs/design.md section 4): give held tokens of version ``V-1`` their proximal logprob under ``V``.

After the weights move to version ``V``, every stored token sampled by ``V-1`` that has no
proximal value yet gets ``log pi_V(x_i | x_<i)`` from a prefill-only engine call, so the
trainer's segment-wise importance weight uses the right policy. Run it right after a weight
update (and before the next pause); a failed engine call leaves the turn as it was
(``proximal == behaviour``, which the trainer can see and mask) and is retried next time.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from typing import Callable, Protocol

from ..metrics import Metrics
from ..store import NotFound, Store, TurnRecord

log = logging.getLogger(__name__)


class PrefillPool(Protocol):
    async def prefill_logprobs(self, *, input_ids: list[int], start: int, session_id: str) -> list[float]:
        """One logprob per token ``input_ids[start:]``: ``log pi(input_ids[i] | input_ids[:i])``."""
        ...


@dataclass
class RecomputeReport:
    turns: int = 0  # turns that were owed values
    tokens: int = 0  # tokens that got a proximal value
    failures: int = 0  # turns left as they were (engine error or a malformed answer)


def apply_prefill(turn: TurnRecord, values: list[float | None], version: int) -> tuple[list[float], list[int], int]:
    """New proximal arrays for ``turn`` given ``values[i]`` = log pi_version of output token ``i``.

    Only tokens sampled by ``version - 1`` that still lack a proximal value change; ``None``
    or non-finite values are skipped. Returns (proximal_logprobs_t, proximal_versions, changed).
    """
    if len(values) != len(turn.output_ids):
        raise ValueError(f"prefill returned {len(values)} logprobs for {len(turn.output_ids)} output tokens")
    prox = list(turn.proximal_logprobs_t)
    prox_versions = list(turn.proximal_versions)
    changed = 0
    for i, (v, pv) in enumerate(zip(turn.versions, turn.proximal_versions)):
        value = values[i]
        if v == version - 1 and pv == v and value is not None and math.isfinite(value):
            prox[i] = float(value)
            prox_versions[i] = version
            changed += 1
    return prox, prox_versions, changed


async def recompute_owed_report(
    store: Store,
    pool: PrefillPool,
    version: int,
    *,
    session_id_for: Callable[[TurnRecord], str] = lambda t: t.session_id,
    concurrency: int = 2,
) -> RecomputeReport:
    """Recompute every owed turn (see module docstring); commits turn by turn.

    ``concurrency`` workers take owed turns one at a time, loading each only when its prefill
    starts: memory stays bounded however much is owed."""
    owed = store.turns.owed_ids(version)
    report = RecomputeReport(turns=len(owed))
    queue = iter(owed)

    async def one(turn_id: str) -> None:
        turn = store.turns.get(turn_id)
        if turn is None:
            raise NotFound(f"turn {turn_id} disappeared")
        values = await pool.prefill_logprobs(
            input_ids=turn.prompt_ids + turn.output_ids,
            start=len(turn.prompt_ids),
            session_id=session_id_for(turn),
        )
        # Re-read: another recompute may have filled some tokens while we awaited the engine.
        fresh = store.turns.get(turn_id)
        if fresh is None:
            raise NotFound(f"turn {turn_id} disappeared")
        prox, prox_versions, changed = apply_prefill(fresh, list(values), version)
        if changed:
            store.turns.update_proximal(turn_id, prox, prox_versions)
        report.tokens += changed

    async def worker() -> None:
        for turn_id in queue:  # one shared iterator: each turn goes to exactly one worker
            try:
                await one(turn_id)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # an engine error must not stop the others; the turn stays owed
                report.failures += 1
                log.warning("recompute of turn %s under v%d failed: %s", turn_id, version, exc)

    await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
    if report.failures:
        log.warning("recompute under v%d: %d of %d turns failed, %d tokens updated", version, report.failures, report.turns, report.tokens)
    return report


async def recompute_owed(
    store: Store,
    pool: PrefillPool,
    version: int,
    *,
    session_id_for: Callable[[TurnRecord], str] = lambda t: t.session_id,
    concurrency: int = 2,
) -> int:
    """R2 for ``version``; returns the number of tokens that got a proximal value."""
    report = await recompute_owed_report(store, pool, version, session_id_for=session_id_for, concurrency=concurrency)
    return report.tokens


class RecomputeScheduler:
    """Runs R2 for the pool's current version: eagerly after a weight update or resume (in the
    background), before a pause and before a pull (awaited), one run at a time."""

    def __init__(self, store: Store, pool, metrics: Metrics):
        self.store = store
        self.pool = pool
        self.metrics = metrics
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()

    async def run(self) -> int:
        """Recompute what is owed now; returns the number of tokens that got a value."""
        if self.pool.paused:
            return 0
        async with self._lock:
            n = await recompute_owed(self.store, self.pool, self.pool.version)
        if n:
            self.metrics.recomputed.inc(n)
        return n

    def soon(self) -> None:
        """Start a run in the background (failures are logged; the values stay owed)."""
        task = asyncio.get_running_loop().create_task(self._safe_run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _safe_run(self) -> None:
        try:
            await self.run()
        except Exception:
            log.exception("recompute after weight update failed; values stay owed")

    async def drain(self) -> None:
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
