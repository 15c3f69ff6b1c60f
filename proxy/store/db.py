"""The store's one concurrency model: a single writer, and readers that never wait for it.

Writes go through ``write()``: one connection, one lock, one ``BEGIN IMMEDIATE`` transaction
per call, committed before it returns (WAL mode; with ``synchronous=NORMAL`` a commit survives
``kill -9`` of the proxy, only a power loss can drop the last ones; ``FULL`` fsyncs each).
Reads go through ``read()``: every thread gets its own connection, so in WAL mode a read sees
the last committed state without taking the writer's lock. That is what keeps the request
path (lookups on the event loop) and bulk reads (sample assembly for a pull, in a worker
thread) from ever stalling each other or a turn's commit. WAL checkpoints run in a background
thread (PASSIVE: never blocks the writer).
"""

from __future__ import annotations

import os
import sqlite3
import threading
from contextlib import contextmanager
from typing import Iterator

from . import schema


class Database:
    def __init__(self, path: str, *, synchronous: str = "NORMAL", page_size: int = 1024):
        if synchronous.upper() not in ("NORMAL", "FULL", "EXTRA"):
            raise ValueError("synchronous must be NORMAL, FULL or EXTRA (OFF would lose committed turns)")
        self.path = path
        if path != ":memory:" and os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        self._wlock = threading.RLock()
        self._writer = self._connect()
        c = self._writer
        # Small pages: turn rows are a few KB and SQLite wastes on average half a cell per page;
        # 1 KiB pages measured ~1 byte/token smaller than 4 KiB. Only applies to a new file.
        c.execute(f"PRAGMA page_size={int(page_size)}")
        c.execute("PRAGMA journal_mode=WAL")
        c.execute(f"PRAGMA synchronous={synchronous.upper()}")
        c.execute("PRAGMA journal_size_limit=67108864")  # keep the WAL file from growing without bound
        with self._wlock:
            schema.apply(c, path)
        self._local = threading.local()
        self._readers: list[sqlite3.Connection] = []
        self._readers_lock = threading.Lock()
        self._closing = threading.Event()
        self._checkpointer: threading.Thread | None = None
        if path != ":memory:":
            c.execute("PRAGMA wal_autocheckpoint=0")
            self._checkpointer = threading.Thread(target=self._checkpoint_loop, name="splice-wal-checkpoint", daemon=True)
            self._checkpointer.start()

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=10.0)

    @contextmanager
    def write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction; commits on success, rolls back on any exception."""
        with self._wlock:
            self._writer.execute("BEGIN IMMEDIATE")
            try:
                yield self._writer
            except BaseException:
                self._writer.execute("ROLLBACK")
                raise
            self._writer.execute("COMMIT")

    @contextmanager
    def read(self, *, snapshot: bool = False) -> Iterator[sqlite3.Connection]:
        """This thread's read connection; ``snapshot=True`` wraps the block in one read transaction
        so several statements see the same committed state."""
        if self.path == ":memory:":  # one connection is the only view of an in-memory database
            with self._wlock:
                yield self._writer
            return
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = self._connect()
            with self._readers_lock:
                self._readers.append(conn)
        if not snapshot or conn.in_transaction:
            yield conn
            return
        conn.execute("BEGIN")
        try:
            yield conn
        finally:
            conn.execute("COMMIT")

    def _checkpoint_loop(self, interval_s: float = 1.0) -> None:
        conn = self._connect()
        try:
            while not self._closing.wait(interval_s):
                try:
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
                except sqlite3.Error:
                    pass  # busy or closing: the next round catches up
        finally:
            conn.close()

    def file_bytes(self) -> int:
        return sum(_size(self.path + suffix) for suffix in ("", "-wal"))

    def close(self) -> None:
        self._closing.set()
        if self._checkpointer is not None:
            self._checkpointer.join(timeout=5)
        with self._wlock:
            self._writer.close()
        with self._readers_lock:
            for conn in self._readers:
                conn.close()
            self._readers.clear()


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
