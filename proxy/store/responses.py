"""Stored Responses API objects: ``GET /v1/responses/{id}`` and what ``previous_response_id``
expands to. A response's conversation usually extends the session's previous one, so it is
stored as a delta against it (bounded chain length)."""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from typing import Callable

from .db import Database
from .errors import Conflict
from .lru import LRU, memory_of
from .packing import common_bytes

_MAX_CONV_DEPTH = 16  # a stored conversation is rebuilt from at most this many deltas
_MIN_SHARED_BYTES = 64
# Decoded conversations kept in memory, counted by what they really hold (object and entry, not
# JSON length). A session's newest conversation contains its earlier ones, so storing a response
# drops its base from the cache: about one conversation per recent session is held, and an
# older one is rebuilt from its deltas (at most ``_MAX_CONV_DEPTH``) when asked for.
CONVERSATION_CACHE_BYTES = 16 << 20


@dataclass(frozen=True)
class StoredResponse:
    """What a Responses turn stores with the turn, in the turn's own transaction."""

    response_id: str
    body: bytes  # the Response object as returned (JSON)
    conversation: bytes  # the messages ``previous_response_id`` expands to (JSON list)


class ResponseTable:
    def __init__(self, db: Database, clock: Callable[[], float] = time.time):
        self.db = db
        self.clock = clock
        self._convs = LRU(CONVERSATION_CACHE_BYTES, weigh=memory_of)  # response seq -> conversation bytes

    def put(self, response_id: str, session_id: str, turn_id: str | None, body: bytes, conversation: bytes) -> None:
        """Store a response on its own (commits). Turns store theirs through ``insert``."""
        with self.db.write() as c:
            seq = self.insert(c, StoredResponse(response_id, bytes(body), bytes(conversation)), session_id, turn_id)
        self.remember(seq, conversation)

    def remember(self, seq: int, conversation: bytes) -> None:
        """Cache a stored conversation; only after its COMMIT (a rolled-back seq may be reused)."""
        self._convs.put(seq, bytes(conversation))

    def insert(self, c, resp: StoredResponse, session_id: str, turn_id: str | None) -> int:
        """Inside the caller's write transaction; returns the row's seq for ``remember``."""
        conv = resp.conversation
        if c.execute("SELECT 1 FROM responses WHERE response_id = ?", (resp.response_id,)).fetchone():
            raise Conflict(f"response {resp.response_id!r} already stored")
        base = c.execute(
            "SELECT seq, conv_depth FROM responses WHERE session_id = ? ORDER BY seq DESC LIMIT 1", (session_id,)
        ).fetchone()
        base_seq, base_len, depth = None, 0, 0
        if base is not None and base[1] + 1 < _MAX_CONV_DEPTH:
            shared = common_bytes(self._conversation(c, base[0]), conv)
            if shared >= _MIN_SHARED_BYTES:
                base_seq, base_len, depth = base[0], shared, base[1] + 1
        if base is not None:
            self._convs.pop(base[0])  # superseded by this one (safe even if this transaction rolls back)
        cur = c.execute(
            "INSERT INTO responses (response_id, session_id, turn_id, created_at, body, conv_base, conv_base_len, "
            "conv_tail, conv_depth) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                resp.response_id,
                session_id,
                turn_id,
                self.clock(),
                zlib.compress(resp.body, 6),
                base_seq,
                base_len,
                zlib.compress(conv[base_len:], 6),
                depth,
            ),
        )
        return cur.lastrowid

    def _conversation(self, c, seq: int) -> bytes:
        hit = self._convs.get(seq)
        if hit is not None:
            return hit
        base, base_len, tail = c.execute(
            "SELECT conv_base, conv_base_len, conv_tail FROM responses WHERE seq = ?", (seq,)
        ).fetchone()
        head = b"" if base is None else self._conversation(c, base)[:base_len]
        conv = head + zlib.decompress(tail)
        self._convs.put(seq, conv)
        return conv

    def get(self, response_id: str) -> tuple[bytes, bytes] | None:
        """(body, conversation), or None."""
        with self.db.read() as c:
            row = c.execute("SELECT seq, body FROM responses WHERE response_id = ?", (response_id,)).fetchone()
            if row is None:
                return None
            return zlib.decompress(row[1]), self._conversation(c, row[0])
