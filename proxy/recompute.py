"""R2 (SPEC section 4): give held tokens of version ``V-1`` their proximal logprob under ``V``.

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

from proxy.records import TurnRecord
from proxy.store import NotFound, Store

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
    """Recompute every owed turn (see module docstring); commits turn by turn."""
    owed = store.owed_recompute(version)
    report = RecomputeReport(turns=len(owed))
    gate = asyncio.Semaphore(max(1, concurrency))

    async def one(turn: TurnRecord) -> None:
        try:
            async with gate:
                values = await pool.prefill_logprobs(
                    input_ids=turn.prompt_ids + turn.output_ids,
                    start=len(turn.prompt_ids),
                    session_id=session_id_for(turn),
                )
            # Re-read: another recompute may have filled some tokens while we awaited the engine.
            fresh = store.get_turn(turn.turn_id)
            if fresh is None:
                raise NotFound(f"turn {turn.turn_id} disappeared")
            prox, prox_versions, changed = apply_prefill(fresh, list(values), version)
            if changed:
                store.update_proximal(turn.turn_id, prox, prox_versions)
            report.tokens += changed
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an engine error must not stop the others; the turn stays owed
            report.failures += 1
            log.warning("recompute of turn %s (session %s) under v%d failed: %s", turn.turn_id, turn.session_id, version, exc)

    await asyncio.gather(*(one(t) for t in owed))
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
