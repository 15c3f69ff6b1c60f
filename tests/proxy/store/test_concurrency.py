"""The store's concurrency model: a pull assembles samples without holding the writer, so a
turn commits (and a request-path read answers) while a large pull is still being built."""

from __future__ import annotations

import threading

from proxy.store import pool as pool_mod


def test_turn_commits_while_a_pull_is_assembling(store, make_turn, monkeypatch):
    for k in range(20):  # many ready sessions with long samples
        sid = f"r{k}"
        store.sessions.upsert(sid)
        store.turns.add(make_turn(sid, 0, list(range(2000)), list(range(3000, 5000))))
        store.sessions.set_reward(sid, 1.0)
    store.sessions.upsert("live")

    inside, release = threading.Event(), threading.Event()
    real = pool_mod.assemble_samples

    def slow_assembly(session, turns, **kw):
        inside.set()
        assert release.wait(30), "the test never released the pull"
        return real(session, turns, **kw)

    monkeypatch.setattr(pool_mod, "assemble_samples", slow_assembly)
    pulled: list = []
    puller = threading.Thread(target=lambda: pulled.append(store.pool.pull(100, 60.0)))
    puller.start()
    assert inside.wait(30)

    committed = threading.Event()

    def commit() -> None:
        store.turns.add(make_turn("live", 0, [1, 2, 3], [4, 5]))
        assert store.turns.get("live-t0") is not None and store.sessions.get("live") is not None
        committed.set()

    writer = threading.Thread(target=commit)
    writer.start()
    done_while_pulling = committed.wait(10)  # bounded so a regression fails instead of hanging
    release.set()
    puller.join(30)
    writer.join(30)
    assert done_while_pulling, "a turn's commit waited for the pull's sample assembly"
    lease_id, samples = pulled[0]
    assert lease_id and len(samples) == 20 and all(len(s["input_ids"]) == 4000 for s in samples)


def test_a_session_taken_by_a_racing_pull_is_not_leased_twice(store, make_turn, monkeypatch):
    store.sessions.upsert("a")
    store.turns.add(make_turn("a", 0, [1], [2]))
    store.sessions.set_reward("a", 1.0)
    real = pool_mod.assemble_samples
    raced: list = []

    def assemble_then_race(session, turns, **kw):
        out = real(session, turns, **kw)
        if not raced:  # another trainer's pull leases the same session meanwhile
            raced.append(True)
            monkeypatch.setattr(pool_mod, "assemble_samples", real)
            raced.append(store.pool.pull(10, 60.0))
        return out

    monkeypatch.setattr(pool_mod, "assemble_samples", assemble_then_race)
    lease, samples = store.pool.pull(10, 60.0)
    other_lease, other_samples = raced[1]
    assert other_lease and len(other_samples) == 1
    assert lease is None and samples == []
