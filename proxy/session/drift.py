"""Counting the retokenization drift splicing avoided: would a full re-render of a spliced
turn's conversation have produced different prompt ids? Runs off the hot path, in a thread.

A turn spliced onto a turn that drifted drifts too (the re-render repeats the earlier
difference), so only sessions that have not drifted yet pay for a full render; ``sampled``
mode renders turns 1, 2, 4, 8, ... of those, within a budget: every spliced turn earns
``TOKENS_PER_TURN`` tokens of re-rendering and a check spends its prompt's length, so the
checks' CPU per turn stays bounded however long conversations grow. The budget saves up at
most ``MAX_BUDGET`` tokens, so prompts longer than that are only checked under ``all``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Coroutine

import numpy as np

from tokenization import ChatFormat

from ..metrics import Metrics
from ..store import Store
from ..store.lru import LRU
from .turn import TurnRequest, TurnResult

log = logging.getLogger("splice.drift")


TOKENS_PER_TURN = 256  # "sampled": re-rendered tokens each spliced turn pays for (a short session uses ~150)
START_BUDGET = 1 << 15  # a fresh proxy checks its first long session at once
MAX_BUDGET = 1 << 16  # what a quiet spell can save up: prompts longer than this are checked only under "all"


class DriftChecker:
    def __init__(self, fmt: ChatFormat, store: Store, metrics: Metrics, mode: str):
        self.fmt = fmt
        self.store = store
        self.metrics = metrics
        self.mode = mode
        self._drifted = LRU(65536, sized=False)  # turn id -> a full re-render would differ
        self._budget = START_BUDGET  # "sampled": tokens of re-rendering not yet spent
        self.skipped = 0  # due checks skipped for the budget (a count for tests and benches)

    def due(self, index: int) -> bool:
        if self.mode == "all":
            return True
        if self.mode == "off":
            return False
        return index > 0 and (index & (index - 1)) == 0  # sampled: turns 1, 2, 4, 8, ...

    def inherited(self, parent_turn_id: str | None) -> bool:
        """True when the parent is known to have drifted: so has this turn, and its commit can
        say so (no second write after the fact)."""
        return bool(parent_turn_id) and self._drifted.get(parent_turn_id) is True

    def note(
        self, req: TurnRequest, result: TurnResult, parent_turn_id: str | None, *, recorded: bool = False
    ) -> Coroutine[Any, Any, None] | None:
        """What a spliced turn's check decides at once; the work left (a full render in a thread,
        a drift flag written) as a coroutine to run in the background, or None, as for most turns:
        their parent's outcome is inherited, or they are not due. ``recorded``: the turn was
        committed with ``drift`` set (:meth:`inherited`)."""
        if self.mode == "sampled":
            self._budget = min(MAX_BUDGET, self._budget + TOKENS_PER_TURN)
        drifted = self._drifted.get(parent_turn_id) if parent_turn_id else None
        if drifted is not None:
            return self._record(result, drifted, recorded)
        if not self.due(result.index):
            return None
        if self.mode == "sampled":
            if len(result.prompt_ids) > self._budget:
                self.skipped += 1
                return None
            self._budget -= len(result.prompt_ids)
        return self._render_and_record(req, result, recorded)

    async def _render_and_record(self, req: TurnRequest, result: TurnResult, recorded: bool) -> None:
        try:
            full = await asyncio.to_thread(self.fmt.render, req.messages, req.tools, template_kwargs=req.chat_template_kwargs)
        except Exception:  # noqa: BLE001 - a template that cannot re-render counts as no drift
            return
        drifted = not np.array_equal(np.asarray(full, dtype=np.int64), np.asarray(result.prompt_ids, dtype=np.int64))
        work = self._record(result, drifted, recorded)
        if work is not None:
            await work

    def _record(self, result: TurnResult, drifted: bool, recorded: bool) -> Coroutine[Any, Any, Any] | None:
        self._drifted.put(result.turn_id, drifted)
        if not drifted:
            return None
        self.metrics.drift.inc()
        return None if recorded else self.store.turns.set_drift_grouped(result.turn_id, True)
