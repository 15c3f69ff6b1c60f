"""The WAL starts over under steady load instead of growing for as long as the load lasts.

SQLite rewinds the WAL only at a commit that finds every frame copied into the database; a
PASSIVE checkpoint alone never gets there while commits keep arriving. The WAL header's
checkpoint sequence number (bytes 12-16, https://www.sqlite.org/fileformat.html#walformat)
counts the rewinds.
"""

from __future__ import annotations

import os
import struct
import time

from proxy.store.db import RESTART_FRAMES, Database


def _rewinds(wal: str) -> int:
    with open(wal, "rb") as f:
        return struct.unpack(">I", f.read(16)[12:16])[0]


def test_steady_commits_rewind_the_wal_and_keep_it_small(tmp_path):
    """The default ``restart_frames`` (16 MiB of 1 KiB pages); a short checkpoint interval so
    the test needs seconds, not minutes. Commits never pause long enough for a checkpoint to
    catch up on its own."""
    path = str(tmp_path / "s.sqlite")
    db = Database(path, checkpoint_interval_s=0.05)
    frame = 1024 + 24  # page + frame header
    try:
        with db.write() as c:
            c.execute("CREATE TABLE t (k INTEGER PRIMARY KEY, v BLOB)")
        blob = os.urandom(30_000)  # about 30 pages per commit
        n, largest, deadline = 0, 0, time.monotonic() + 60
        while n * len(blob) < 5 * RESTART_FRAMES * frame and time.monotonic() < deadline:
            with db.write() as c:
                c.execute("INSERT INTO t (v) VALUES (?)", (blob,))
            n += 1
            if n % 20 == 0:
                largest = max(largest, os.path.getsize(path + "-wal"))
            time.sleep(0.0005)
        assert _rewinds(path + "-wal") >= 2, "the WAL never started over: it grows as long as commits keep coming"
        assert largest < 2 * RESTART_FRAMES * frame, f"WAL reached {largest} bytes for {n * len(blob)} committed"
        with db.read() as c:
            assert c.execute("SELECT count(*), sum(length(v)) FROM t").fetchone() == (n, n * len(blob))
    finally:
        db.close()


def test_the_committing_thread_reads_through_the_writer_and_never_sees_uncommitted_rows(tmp_path):
    """``read_through_writer``: the thread that commits reads through the writer's connection
    (its page cache is warm); a write another thread holds open is waited for, never read."""
    import threading

    db = Database(str(tmp_path / "s.sqlite"))
    try:
        with db.write() as c:
            c.execute("CREATE TABLE t (k INTEGER PRIMARY KEY)")
            c.execute("INSERT INTO t VALUES (1)")
        with db.read() as c:
            assert c.total_changes == 0  # a reader's own connection: it changed nothing
        db.read_through_writer()
        with db.read() as c:
            assert c.total_changes > 0 and c.execute("SELECT count(*) FROM t").fetchone() == (1,)

        inside, release = threading.Event(), threading.Event()

        def rolled_back_write() -> None:
            try:
                with db.write() as w:
                    w.execute("INSERT INTO t VALUES (2)")
                    inside.set()
                    release.wait(10)
                    raise RuntimeError("rolled back")
            except RuntimeError:
                pass

        other = threading.Thread(target=rolled_back_write)
        other.start()
        assert inside.wait(10)
        threading.Timer(0.2, release.set).start()
        with db.read() as c:  # waits for the other thread's transaction instead of reading into it
            assert c.execute("SELECT count(*) FROM t").fetchone() == (1,)
        other.join(10)
        seen: list = []

        def read_elsewhere() -> None:
            with db.read() as c:
                seen.append(c.total_changes)

        reader = threading.Thread(target=read_elsewhere)
        reader.start()
        reader.join(10)
        assert seen == [0]  # other threads keep their own connections
    finally:
        db.close()
