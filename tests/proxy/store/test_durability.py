"""What a call returned is on disk: close/reopen and a real ``kill -9`` of a writing process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from proxy.store import Store

REPO = Path(__file__).resolve().parents[2]

WRITER = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[2])
    from proxy.store.records import TurnRecord
    from proxy.store import Store

    store = Store(sys.argv[1])
    k = 0
    while True:  # until killed
        sid = f"s{k}"
        store.sessions.upsert(sid, group_id="g", metadata={"k": k})
        prompt = [1, 2, 3]
        for i in range(3):
            n = 50
            out = [(k * 7 + i * 3 + j) % 1000 for j in range(n)]
            lps = [-(j + 1) / 64 for j in range(n)]
            t = TurnRecord(f"{sid}-t{i}", sid, i, None, prompt, out, lps, [k] * n, lps, [k] * n,
                           i > 0, None, "stop", 0.0, {}, False, "chat", f"chatcmpl-{sid}-{i}")
            store.turns.add(t)
            print("turn", sid, i, flush=True)
            prompt = prompt + out + [4]
        store.responses.put(f"resp_{sid}", sid, f"{sid}-t2", b"body", b"[conversation]" * 10)
        print("response", sid, flush=True)
        store.sessions.set_reward(sid, k / 2)
        print("reward", sid, flush=True)
        k += 1
    """
)


def test_close_and_reopen_keeps_everything(db_path, make_turn):
    store = Store(db_path)
    store.sessions.upsert("s", group_id="g", group_size=2, metadata={"x": [1, 2]})
    turns = [make_turn("s", 0, [1, 2], [3, 4]), make_turn("s", 1, [1, 2, 3, 4, 5], [6], version=1)]
    store.turns.add(turns[0])
    store.turns.add(turns[1], fingerprints=[b"fp"])
    store.responses.put("resp_1", "s", "s-t1", b"{}", b"[1]")
    session = store.sessions.set_reward("s", 2.0)
    store.close()
    store = Store(db_path)
    assert store.sessions.get("s") == session
    assert store.turns.list("s") == turns
    assert [c.turn_id for c in store.turns.candidates(b"fp")] == ["s-t1"]
    assert store.responses.get("resp_1") == (b"{}", b"[1]")
    store.close()


def test_kill_9_loses_nothing_that_returned(db_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, db_path, str(REPO)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    done: list[list[str]] = []
    deadline = time.monotonic() + 30
    try:
        while len(done) < 40 and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            done.append(line.split())
        os.kill(proc.pid, signal.SIGKILL)  # mid-write, no chance to close or checkpoint
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert len(done) >= 40, proc.stderr.read()
    assert Path(db_path + "-wal").exists()  # the commits live in the WAL, not yet checkpointed

    store = Store(db_path)
    for kind, sid, *rest in done:
        session = store.sessions.get(sid)
        assert session is not None and session.group_id == "g"
        if kind == "turn":
            turn = store.turns.get(f"{sid}-t{rest[0]}")
            assert turn is not None and len(turn.output_ids) == 50
            assert turn.versions == [int(sid[1:])] * 50
        elif kind == "response":
            assert store.responses.get(f"resp_{sid}") == (b"body", b"[conversation]" * 10)
        else:
            assert session.reward == int(sid[1:]) / 2 and session.closed
    rewarded = {sid for kind, sid, *_ in done if kind == "reward"}
    lease, samples = store.pool.pull(1000, 60.0)
    assert {s["session_id"] for s in samples} >= rewarded
    store.close()
