"""``SessionTable.for_turn``: the turn path's read of its session, kept between turns.

A kept copy must never hide a change made through the table: a reward (the session closes), a
group filled in, a session created. A read that overlapped a change is not kept."""

from __future__ import annotations

from proxy.store import Store


def _queries(store: Store) -> list[str]:
    seen: list[str] = []
    store.db._writer.set_trace_callback(seen.append)
    store.db.read_through_writer()  # reads on this thread go through the traced connection
    return seen


def _session_reads(seen: list[str]) -> int:
    return sum(q.startswith("SELECT session_id, group_id") for q in seen)


def test_a_kept_copy_saves_the_read_and_every_change_shows(db_path):
    store = Store(db_path)
    seen = _queries(store)
    assert store.sessions.for_turn("s") is None  # unknown: nothing kept
    store.sessions.upsert("s")
    first = store.sessions.for_turn("s")
    n = _session_reads(seen)
    assert store.sessions.for_turn("s") == first and _session_reads(seen) == n  # kept: no query
    store.sessions.upsert("s", group_id="g", group_size=4)
    assert (store.sessions.for_turn("s").group_id, store.sessions.for_turn("s").group_size) == ("g", 4)
    store.sessions.upsert("s", metadata={"task": 7})
    assert store.sessions.for_turn("s").metadata == {"task": 7}
    assert not store.sessions.for_turn("s").closed
    store.sessions.set_reward("s", 1.0)
    assert store.sessions.for_turn("s").closed
    store.close()


def test_a_read_that_overlaps_a_change_is_not_kept(db_path):
    store = Store(db_path)
    store.sessions.upsert("s")
    table = store.sessions
    real_get = table.get

    def get_then_reward(session_id):
        rec = real_get(session_id)  # the session as it was: open
        table.set_reward(session_id, 0.5)  # closed while that read was on its way back
        return rec

    table.get = get_then_reward
    assert not table.for_turn("s").closed  # this caller saw it open, as a plain read would
    table.get = real_get
    assert table.for_turn("s").closed  # but it was not kept
    store.close()
