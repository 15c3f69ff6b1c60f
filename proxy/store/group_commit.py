"""Group commit: the turns that finish in the same pass of the event loop share one transaction.

A turn's commit is a handful of INSERTs plus ``BEGIN IMMEDIATE`` and ``COMMIT``; under load the
last two (a file lock and a WAL append each) are a fair part of the store's CPU. ``submit`` queues
a turn's writes and schedules one flush for the next pass of the loop; the flush runs every
queued write in its own ``SAVEPOINT`` inside one transaction, so a write that fails (a closed
session, a duplicate id) rolls back alone and the rest commit. Nothing is answered before its
transaction has committed: a ``kill -9`` loses only turns whose callers are still waiting, as
without grouping. A caller cancelled before the flush is left out of it (its future is cancelled,
so nothing of it is written). A turn that no other can join (its caller knows none is open
beside it: ``now=True``) is flushed at once, without waiting a pass of the loop for company.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from .db import Database

Work = Callable[[Any], Any]  # gets the open connection; its result goes to the caller


class GroupCommit:
    def __init__(self, db: Database):
        self.db = db
        self._queue: list[tuple[Work, asyncio.Future, bool]] = []  # (work, its future, whether it is a turn)
        self.on_flush: Callable[[int], None] | None = None  # turns per transaction, for /metrics

    def submit(self, work: Work, *, turn: bool = True, now: bool = False) -> asyncio.Future:
        """Queue ``work``; the future resolves once the transaction holding it has committed.
        ``turn=False``: a small write riding along (a flag), left out of the turns counted.
        ``now``: no other turn can join this pass (the only one open): the queue is flushed
        before this returns, and the pass scheduled for it, if any, finds nothing left."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._queue.append((work, fut, turn))
        if now:
            self._flush()
        elif len(self._queue) == 1:
            loop.call_soon(self._flush)
        return fut

    def _flush(self) -> None:
        batch = [(work, fut) for work, fut, _ in self._queue if not fut.cancelled()]
        turns = sum(turn for _, fut, turn in self._queue if not fut.cancelled())
        self._queue = []
        if not batch:
            return
        outcomes: list[tuple[asyncio.Future, BaseException | None, Any]] = []
        if len(batch) == 1:  # a group of one (C=1) needs no savepoint: its transaction is its own
            self._flush_one(*batch[0], turns)
            return
        try:
            with self.db.write() as c:
                for work, fut in batch:
                    c.execute("SAVEPOINT turn")
                    try:
                        out = work(c)
                    except Exception as exc:  # noqa: BLE001 - this write alone is undone and reported
                        c.execute("ROLLBACK TO turn")
                        c.execute("RELEASE turn")
                        outcomes.append((fut, exc, None))
                        continue
                    c.execute("RELEASE turn")
                    outcomes.append((fut, None, out))
        except Exception as exc:  # noqa: BLE001 - BEGIN or COMMIT failed: nothing of the group is stored
            for _, fut in batch:
                fut.set_exception(exc)
            return
        for fut, exc, out in outcomes:  # nothing yielded since the cancelled ones were dropped
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(out)
        if self.on_flush is not None and turns:
            self.on_flush(turns)

    def _flush_one(self, work: Work, fut: asyncio.Future, turns: int) -> None:
        try:
            with self.db.write() as c:
                out = work(c)
        except Exception as exc:  # noqa: BLE001 - rolled back; the caller gets the error
            fut.set_exception(exc)
            return
        fut.set_result(out)
        if self.on_flush is not None and turns:
            self.on_flush(turns)
