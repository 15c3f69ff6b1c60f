"""Group commit: turns that finish in the same pass of the event loop share one transaction, each
in its own savepoint. A failing turn fails alone, a cancelled one is not written, and nothing is
answered before it is on disk (a real ``kill -9`` of a writing process)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest

from proxy.store import Conflict, Store
from proxy.store.turns import _set_drift

REPO = Path(__file__).resolve().parents[3]


def _store(db_path) -> tuple[Store, list[int]]:
    store = Store(db_path)
    groups: list[int] = []
    store.turns.group.on_flush = groups.append
    return store, groups


def test_turns_finishing_together_commit_in_one_transaction_as_add_would(db_path, make_turn, tmp_path):
    store, groups = _store(db_path)
    turns = []
    for k in range(5):
        store.sessions.upsert(f"s{k}")
        turns.append(make_turn(f"s{k}", 0, [1, 2, k], [3, 4, 5 + k]))

    async def go():
        return await asyncio.gather(*(store.turns.add_grouped(t, on_lost=pytest.fail, fingerprints=[b"fp%d" % i])
                                      for i, t in enumerate(turns)))  # fmt: skip

    assert asyncio.run(go()) == turns
    assert groups == [5]
    reference = Store(str(tmp_path / "one-by-one.sqlite"))  # the same turns through add, one transaction each
    for k, t in enumerate(turns):
        reference.sessions.upsert(f"s{k}")
        reference.turns.add(t, fingerprints=[b"fp%d" % k])
    store.close()
    store = Store(db_path)
    for k in range(5):
        assert store.turns.list(f"s{k}") == reference.turns.list(f"s{k}") == [turns[k]]
        assert [c.turn_id for c in store.turns.candidates(b"fp%d" % k)] == [f"s{k}-t0"]


def test_a_drift_flag_rides_along_a_turns_transaction_and_is_not_counted(db_path, make_turn):
    """The drift checker's flag joins the loop's next group commit (no transaction or thread
    of its own); the group-size metric still counts turns only, and a flag for an unknown
    turn fails alone."""
    store, groups = _store(db_path)
    store.sessions.upsert("a")
    first = make_turn("a", 0, [1], [2])
    store.turns.add(first)

    async def go():
        flag = store.turns.set_drift_grouped(first.turn_id)
        turn = store.turns.add_grouped(make_turn("a", 1, [1, 2, 3], [4], parent=first.turn_id), on_lost=pytest.fail)
        missing = store.turns.set_drift_grouped("nope")
        return await asyncio.gather(flag, turn, missing, return_exceptions=True)

    flag, _, missing = asyncio.run(go())
    assert flag is None and "nope" in str(missing)
    assert groups == [1]  # one transaction: one turn counted, two flag writes not
    assert [t.drift for t in store.turns.list("a")] == [True, False]

    async def alone():
        await store.turns.set_drift_grouped(first.turn_id, False)

    asyncio.run(alone())
    assert groups == [1] and store.turns.list("a")[0].drift is False


def test_a_commit_now_returns_done_and_takes_the_writes_queued_before_it(db_path, make_turn):
    """``now``: the flush runs inside ``submit``, so the turn's coroutine completes without ever
    suspending, and a flag queued earlier (whose pass is still to come) rides in the same
    transaction; that pass then finds nothing left."""
    store, groups = _store(db_path)
    store.sessions.upsert("a")
    first = make_turn("a", 0, [1], [2])
    store.turns.add(first)

    async def main():
        flag = store.turns.group.submit(lambda c: _set_drift(c, first.turn_id, True), turn=False)
        coro = store.turns.add_grouped(make_turn("a", 1, [1, 2, 3], [4], parent=first.turn_id), on_lost=pytest.fail,
                                       alone=True)  # fmt: skip
        with pytest.raises(StopIteration):
            coro.send(None)  # done on its first step: no pass of the loop was awaited
        assert flag.done() and flag.exception() is None and groups == [1]
        await asyncio.sleep(0)  # the pass scheduled for the flag
        assert groups == [1]

    asyncio.run(main())
    assert [t.drift for t in store.turns.list("a")] == [True, False]


def test_a_failing_turn_fails_alone_and_the_group_commits(db_path, make_turn):
    store, groups = _store(db_path)
    for sid in ("a", "b", "c", "e"):
        store.sessions.upsert(sid)
    store.turns.add(make_turn("b", 0, [1], [2]))
    store.sessions.set_reward("c", 1.0)  # closed: takes no more turns

    async def go():
        return await asyncio.gather(
            store.turns.add_grouped(make_turn("a", 0, [1], [2]), on_lost=pytest.fail),
            store.turns.add_grouped(make_turn("b", 0, [1], [9], turn_id="b-t0"), on_lost=pytest.fail),  # duplicate id
            store.turns.add_grouped(make_turn("c", 1, [1], [2]), on_lost=pytest.fail),
            store.turns.add_grouped(make_turn("d", 0, [5], [6]), on_lost=pytest.fail),  # no session d
            # its turn row goes in, then its response id clashes: the savepoint takes the row back out
            store.turns.add_grouped(replace(make_turn("e", 0, [1], [2]), response_id="resp_b-t0"), on_lost=pytest.fail),
            return_exceptions=True,
        )  # fmt: skip

    ok, dup, closed, missing, clash = asyncio.run(go())
    assert ok.turn_id == "a-t0" and isinstance(dup, Conflict) and isinstance(closed, Conflict)
    assert type(missing).__name__ == "NotFound" and isinstance(clash, Conflict) and "resp_b-t0" in str(clash)
    assert groups == [5]
    assert store.turns.get("e-t0") is None and store.turns.list("e") == []
    assert [t.output_ids for t in store.turns.list("a")] == [[2]]
    assert [t.output_ids for t in store.turns.list("b")] == [[2]]  # the stored one, untouched
    assert store.turns.list("c") == [] and store.turns.get("d-t0") is None


def test_cancelled_before_the_flush_is_not_written_after_it_is_kept_and_reported(db_path, make_turn):
    store, groups = _store(db_path)
    for sid in ("early", "late", "other"):
        store.sessions.upsert(sid)
    lost: list[str] = []

    async def go():
        early = asyncio.ensure_future(store.turns.add_grouped(make_turn("early", 0, [1], [2]), on_lost=lambda: lost.append("early")))
        other = asyncio.ensure_future(store.turns.add_grouped(make_turn("other", 0, [1], [2]), on_lost=lambda: lost.append("other")))
        await asyncio.sleep(0)  # both queued, flush not yet run
        early.cancel()
        await other
        with pytest.raises(asyncio.CancelledError):
            await early
        late = asyncio.ensure_future(store.turns.add_grouped(make_turn("late", 0, [1], [2]), on_lost=lambda: lost.append("late")))
        await asyncio.sleep(0)  # queued
        await asyncio.sleep(0)  # flushed and committed; the task has not resumed yet
        assert groups[-1] == 1 and not late.done()
        late.cancel()
        with pytest.raises(asyncio.CancelledError):
            await late

    asyncio.run(go())
    assert store.turns.list("early") == []
    assert [t.turn_id for t in store.turns.list("other")] == ["other-t0"]
    assert [t.turn_id for t in store.turns.list("late")] == ["late-t0"] and lost == ["late"]
    assert groups == [1, 1]


WRITER = textwrap.dedent(
    """
    import asyncio, sys
    sys.path.insert(0, sys.argv[2])
    from proxy.store.records import TurnRecord
    from proxy.store import Store

    store = Store(sys.argv[1])

    async def session(w):
        for k in range(10**9):  # until killed
            sid = f"w{w}-s{k}"
            store.sessions.upsert(sid)
            prompt = [1, 2, 3]
            for i in range(3):
                out = [(k * 7 + i * 3 + j) % 1000 for j in range(40)]
                lps = [-(j + 1) / 64 for j in range(40)]
                t = TurnRecord(f"{sid}-t{i}", sid, i, None, prompt, out, lps, [k] * 40, lps, [k] * 40,
                               i > 0, None, "stop", 0.0, {}, False, "chat", f"chatcmpl-{sid}-{i}")
                await store.turns.add_grouped(t, on_lost=lambda: None)
                print("turn", sid, i, flush=True)
                prompt = prompt + out + [4]

    async def main():
        await asyncio.gather(*(session(w) for w in range(8)))

    asyncio.run(main())
    """
)


def test_kill9_loses_no_turn_that_was_answered(tmp_path):
    db = str(tmp_path / "grouped.sqlite")
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    proc = subprocess.Popen([sys.executable, str(script), db, str(REPO)], stdout=subprocess.PIPE, text=True)
    answered: list[tuple[str, int]] = []
    deadline = time.monotonic() + 60
    while len(answered) < 400 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        _, sid, i = line.split()
        answered.append((sid, int(i)))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert len(answered) >= 400, "the writer stopped early"
    store = Store(db)
    for sid, i in answered:
        t = store.turns.get(f"{sid}-t{i}")
        assert t is not None and t.index == i and len(t.output_ids) == 40
