"""Closing the store while another thread is still reading: the read finishes, then the
connection closes. Closing a SQLite connection that another thread is stepping crashes the
interpreter (a segfault in a CI run: the proxy shut down while a background read of owed
sessions was still running), so the crash check runs in a child process."""

from __future__ import annotations

import asyncio
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from types import SimpleNamespace

from proxy.metrics import Metrics
from proxy.session.recompute import RecomputeScheduler
from proxy.store.db import Database

ROOT = Path(__file__).resolve().parents[3]

READ_WHILE_CLOSING = textwrap.dedent(
    """
    import sys, threading, time
    from proxy.store.db import Database

    db = Database(sys.argv[1])
    with db.write() as c:
        c.execute("CREATE TABLE t (x INTEGER)")
        c.executemany("INSERT INTO t VALUES (?)", [(i,) for i in range(200)])
    started, got = threading.Event(), []

    def slow(x):  # each row takes 5 ms: the statement is mid-step when close() comes
        started.set()
        time.sleep(0.005)
        return x

    def reader():
        with db.read(snapshot=True) as c:
            c.create_function("slow", 1, slow)
            got.append(c.execute("SELECT SUM(slow(x)) FROM t").fetchone()[0])

    th = threading.Thread(target=reader)
    th.start()
    assert started.wait(10)
    t0 = time.monotonic()
    db.close()
    waited = time.monotonic() - t0
    th.join()
    print(got[0], waited)
    """
)


def test_close_waits_for_a_read_running_in_another_thread(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", READ_WHILE_CLOSING, str(tmp_path / "s.db")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, f"the process died ({proc.returncode}): {proc.stderr[-2000:]}"
    total, waited = proc.stdout.split()
    assert int(total) == sum(range(200))  # the read ran to its end
    assert float(waited) > 0.2  # close() waited for it (200 rows x 5 ms, started just before)


def test_a_read_after_close_is_a_clear_error(tmp_path):
    db = Database(str(tmp_path / "s.db"))
    with db.write() as c:
        c.execute("CREATE TABLE t (x INTEGER)")
    errors: list[BaseException] = []
    opened, closed = threading.Event(), threading.Event()

    def reader() -> None:  # a thread that already has its connection, then reads after close
        with db.read() as c:
            c.execute("SELECT COUNT(*) FROM t").fetchone()
        opened.set()
        closed.wait(10)
        try:
            with db.read() as c:
                c.execute("SELECT COUNT(*) FROM t").fetchone()
        except sqlite3.ProgrammingError as e:
            errors.append(e)

    th = threading.Thread(target=reader)
    th.start()
    assert opened.wait(10)
    db.close()
    closed.set()
    th.join(10)
    assert len(errors) == 1 and "closed" in str(errors[0])

    def fresh() -> None:  # a thread with no connection yet does not open one on a closed store
        try:
            with db.read() as c:
                c.execute("SELECT 1")
        except sqlite3.ProgrammingError as e:
            errors.append(e)

    th = threading.Thread(target=fresh)
    th.start()
    th.join(10)
    assert len(errors) == 2 and "closed" in str(errors[1])
    assert db._readers == {}


def test_drain_waits_for_the_owed_index_read(store, make_turn, monkeypatch):
    """The app closes the store after ``recompute.drain()``; the background read of which
    sessions owe values (started when the version moves) must have ended by then."""
    store.sessions.upsert("s")
    store.turns.add(make_turn("s", 0, [1], [2, 3], version=1))
    inside, release, ended = threading.Event(), threading.Event(), threading.Event()
    real = store.turns.owed_sessions

    def slow_owed(version, **kw):
        inside.set()
        release.wait(10)
        out = real(version, **kw)
        ended.set()
        return out

    monkeypatch.setattr(store.turns, "owed_sessions", slow_owed)
    pool = SimpleNamespace(version=2, urls=["http://e"], prefill_concurrency=2)
    scheduler = RecomputeScheduler(store, pool, Metrics())

    async def main() -> None:
        assert not scheduler.owes("s")  # the version moved: the index is read in the background
        assert await asyncio.to_thread(inside.wait, 10)
        threading.Timer(0.3, release.set).start()
        await scheduler.drain()
        assert ended.is_set()  # drain returned only after the read ended

    asyncio.run(main())
    assert scheduler.owes("s")  # and its result was kept
