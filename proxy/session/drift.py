"""Counting the retokenization drift splicing avoided: would a full re-render of a spliced
turn's conversation have produced different prompt ids? Runs off the hot path, in a thread.

A turn spliced onto a turn that drifted drifts too (the re-render repeats the earlier
difference), so only sessions that have not drifted yet pay for a full render; ``sampled``
mode renders turns 1, 2, 4, 8, ... of those (a render is a full render of the conversation:
its cost over a session stays linear in the session's length).
"""

from __future__ import annotations

import asyncio
import logging

from tokenization import ChatFormat

from ..metrics import Metrics
from ..store import Store
from ..store.lru import LRU
from .turn import TurnRequest, TurnResult

log = logging.getLogger("splice.drift")


class DriftChecker:
    def __init__(self, fmt: ChatFormat, store: Store, metrics: Metrics, mode: str):
        self.fmt = fmt
        self.store = store
        self.metrics = metrics
        self.mode = mode
        self._drifted = LRU(65536, sized=False)  # turn id -> a full re-render would differ

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

    async def check(self, req: TurnRequest, result: TurnResult, parent_turn_id: str | None, *, recorded: bool = False) -> None:
        """``recorded``: the turn was committed with ``drift`` set (:meth:`inherited`)."""
        drifted = self._drifted.get(parent_turn_id) if parent_turn_id else None
        if drifted is None:
            if not self.due(result.index):
                return
            try:
                full = await asyncio.to_thread(
                    self.fmt.render, req.messages, req.tools, template_kwargs=req.chat_template_kwargs
                )
            except Exception:  # noqa: BLE001 - a template that cannot re-render counts as no drift
                return
            drifted = list(full) != result.prompt_ids
        self._drifted.put(result.turn_id, drifted)
        if drifted:
            self.metrics.drift.inc()
            if not recorded:
                await asyncio.to_thread(self.store.turns.set_drift, result.turn_id, True)
