"""The store's one concurrency model: a single writer, and readers in other threads that never wait for it.

Writes go through ``write()``: one connection, one lock, one ``BEGIN IMMEDIATE`` transaction
per call, committed before it returns (WAL mode; with ``synchronous=NORMAL`` a commit survives
``kill -9`` of the proxy, only a power loss can drop the last ones; ``FULL`` fsyncs each).
Reads go through ``read()``: every thread gets its own connection, so in WAL mode a read sees
the last committed state without taking the writer's lock. That is what keeps bulk reads
(sample assembly for a pull, in a worker thread) from ever stalling a turn's commit or the
request path. The thread that commits the turns (the event loop) reads through the writer's
warm cache instead: ``read_through_writer``. WAL checkpoints run in a background
thread (``_checkpoint``: PASSIVE; past 16 MiB, the last frames under the write lock, so the WAL
starts over instead of growing under steady load).
"""

from __future__ import annotations

import os
import sqlite3
import threading
from contextlib import contextmanager
from typing import Iterator

from . import schema


# At most this many WAL frames (pages) are left for the checkpoint pass that holds the write lock.
CHECKPOINT_LOCKED_FRAMES = 256
# A WAL this long (frames: 16 MiB of 1 KiB pages) is started over even under steady load.
RESTART_FRAMES = 16384
# How long ``close`` waits for a read still running in another thread.
CLOSE_WAIT_S = 10.0


class Database:
    def __init__(
        self,
        path: str,
        *,
        synchronous: str = "NORMAL",
        page_size: int = 1024,
        checkpoint_interval_s: float = 1.0,
        restart_frames: int = RESTART_FRAMES,
    ):
        if synchronous.upper() not in ("NORMAL", "FULL", "EXTRA"):
            raise ValueError("synchronous must be NORMAL, FULL or EXTRA (OFF would lose committed turns)")
        self.path = path
        self.checkpoint_interval_s = checkpoint_interval_s
        self.restart_frames = restart_frames
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
        self._writer_thread: int | None = None
        # Each reader's connection with the lock its thread holds while using it: ``close`` takes
        # it first, since closing a connection another thread is stepping crashes the process.
        self._readers: dict[sqlite3.Connection, threading.RLock] = {}
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
        if self.path == ":memory:" or threading.get_ident() == self._writer_thread:
            # The lock held for the whole block: no commit lands in between, so it is a snapshot.
            with self._wlock:
                yield self._writer
            return
        conn, in_use = self._reader()
        with in_use:
            if self._closing.is_set():
                raise sqlite3.ProgrammingError("the store is closed")
            if not snapshot or conn.in_transaction:
                yield conn
                return
            conn.execute("BEGIN")
            try:
                yield conn
            finally:
                conn.execute("COMMIT")

    def _reader(self) -> tuple[sqlite3.Connection, threading.RLock]:
        """This thread's read connection, opened on first use."""
        reader = getattr(self._local, "reader", None)
        if reader is None:
            with self._readers_lock:
                if self._closing.is_set():
                    raise sqlite3.ProgrammingError("the store is closed")
                reader = self._local.reader = (self._connect(), threading.RLock())
                self._readers[reader[0]] = reader[1]
        return reader

    def read_through_writer(self) -> None:
        """From now on the calling thread reads through the writer's connection.

        For the thread that makes the commits (the event loop's group commit): a connection
        drops its page cache whenever another connection has committed since its last read,
        so a reader of its own re-read every B-tree page it needed after each turn; the
        writer's cache already holds them. Such reads wait for a write of another thread,
        as this thread's commits already do."""
        self._writer_thread = threading.get_ident()

    def _checkpoint_loop(self) -> None:
        conn = self._connect()
        try:
            while not self._closing.wait(self.checkpoint_interval_s):
                try:
                    self._checkpoint(conn)
                except sqlite3.Error:
                    pass  # busy or closing: the next round catches up
        finally:
            conn.close()

    def _checkpoint(self, conn: sqlite3.Connection) -> None:
        """Copy the WAL into the database; once it is long, so that the next commit starts it over.

        SQLite starts the WAL over only at a commit that finds it fully copied. Under a steady
        stream of commits a PASSIVE checkpoint never gets there: commits append while it
        copies, so the WAL grew for as long as the load lasted (a GB in seconds of small
        commits). Past ``restart_frames`` frames, passes copy without blocking anyone while each
        finds fewer new frames, and the last few are copied holding the write lock, so none can
        follow them. That pass ends in an fsync of the database, which commits then wait for: a
        millisecond on a local SSD, hence only once per ``restart_frames`` frames, not each
        interval. A reader still on old frames only delays the restart to a later round.
        """
        _, frames, _ = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        if frames < self.restart_frames:
            return
        for _ in range(4):  # the frames commits appended during the last pass
            _, now, _ = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            new, frames = now - frames, now
            if new <= CHECKPOINT_LOCKED_FRAMES:
                break
        with self._wlock:
            conn.execute("PRAGMA wal_checkpoint(PASSIVE)")

    def file_bytes(self) -> int:
        return sum(_size(self.path + suffix) for suffix in ("", "-wal"))

    def close(self) -> None:
        self._closing.set()
        if self._checkpointer is not None:
            self._checkpointer.join(timeout=5)
        with self._wlock:
            self._writer.close()
        with self._readers_lock:
            readers, self._readers = self._readers, {}
        for conn, in_use in readers.items():
            # A read still running (a worker thread the shutdown did not wait for) ends first;
            # one that outlasts the wait keeps its connection, which closes when collected.
            if in_use.acquire(timeout=CLOSE_WAIT_S):
                try:
                    conn.close()
                finally:
                    in_use.release()


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
