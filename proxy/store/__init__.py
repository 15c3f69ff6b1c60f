"""The durable store: sessions, turns, stored responses and trainer leases in one SQLite file.

``Store`` opens the file (``db``: one writer, readers that never wait for it) and hands out
one object per job: ``sessions``, ``turns`` (with their fingerprints and proximal values),
``responses`` (stored Responses API objects) and ``pool`` (pull / ack leases). Token arrays
are packed (``packing``), never JSON; samples are assembled at pull time (``samples``).
"""

from __future__ import annotations

import time
from typing import Callable

from . import leases
from .db import Database
from .errors import Conflict, NotFound, StoreError
from .images import ImageRef, ImageTable, StoredImage
from .pool import TrainingPool
from .records import SessionRecord, TurnRecord
from .responses import ResponseTable, StoredResponse
from .schema import SCHEMA_VERSION, SchemaError
from .sessions import SessionTable
from .turns import Candidate, TurnTable

__all__ = [
    "ImageRef",
    "ImageTable",
    "StoredImage",
    "Candidate",
    "Conflict",
    "NotFound",
    "SCHEMA_VERSION",
    "SchemaError",
    "SessionRecord",
    "Store",
    "StoreError",
    "StoredResponse",
    "TurnRecord",
]


class Store:
    """One SQLite file; see the module docstring."""

    def __init__(
        self,
        path: str,
        *,
        synchronous: str = "NORMAL",
        page_size: int = 1024,
        clock: Callable[[], float] = time.time,
    ):
        self.path = path
        self.clock = clock
        self.db = Database(path, synchronous=synchronous, page_size=page_size)
        self.sessions = SessionTable(self.db, clock)
        self.responses = ResponseTable(self.db, clock)
        self.turns = TurnTable(self.db, self.sessions, self.responses, clock)
        self.images = ImageTable(self.db, clock)
        self.pool = TrainingPool(self.db, self.turns, clock)

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> dict:
        """Counts for /metrics and /admin/status."""
        with self.db.read(snapshot=True) as c:
            now = self.clock()
            sessions, open_, rewarded, pending, acked = c.execute(
                "SELECT COUNT(*), COALESCE(SUM(closed = 0), 0), COALESCE(SUM(reward IS NOT NULL), 0), "
                "COALESCE(SUM(reward IS NOT NULL AND acked = 0 AND lease_id IS NULL), 0), COALESCE(SUM(acked), 0) "
                "FROM sessions"
            ).fetchone()
            turns, out_tokens, prompt_tokens, spliced = c.execute(
                "SELECT COUNT(*), COALESCE(SUM(n_output), 0), COALESCE(SUM(n_prompt), 0), COALESCE(SUM(spliced), 0) FROM turns"
            ).fetchone()
            n_leases, leased = leases.count_active(c, now)
            page_size = c.execute("PRAGMA page_size").fetchone()[0]
            pages = c.execute("PRAGMA page_count").fetchone()[0]
            free = c.execute("PRAGMA freelist_count").fetchone()[0]
        return {
            "sessions": sessions,
            "sessions_open": open_,
            "sessions_rewarded": rewarded,
            "rewards_pending": pending,  # rewarded, not leased, not acked (incl. groups still incomplete)
            "sessions_leased": leased,
            "leases_active": n_leases,
            "sessions_acked": acked,
            "turns": turns,
            "turns_spliced": spliced,
            "tokens": out_tokens,  # generated tokens
            "prompt_tokens": prompt_tokens,
            "db_bytes": (pages - free) * page_size,
            "file_bytes": self.db.file_bytes(),
        }
