"""A spliced turn is stored as its parent's ids plus a tail: the base it names, and what a
fresh store rebuilds from it, must be the prompt the engine was sent.

A splice's prompt is a view of its parent's id chain, so the parent is known to be its prefix
without the query and compare the store makes for other prompts."""

from __future__ import annotations

import numpy as np

from proxy.store import Store
from tests.proxy.store.conftest import build_turn
from tokenization import id_chain


def _statements(store: Store) -> list[str]:
    seen: list[str] = []
    store.db._writer.set_trace_callback(seen.append)
    return seen


def test_a_splice_names_its_parent_as_base_without_looking(db_path):
    store = Store(db_path)
    first = build_turn("s", 0, list(range(100, 400)), [7, 8, 9])
    store.turns.add(first, session_fields={})
    prompt, out = store.turns.ids(first.turn_id)
    bridge = [11, 12, 13, 14]
    spliced = id_chain.join(prompt, out, bridge)  # what the planner builds
    second = build_turn("s", 1, [], [21, 22], parent=first.turn_id)
    second.prompt_ids = spliced
    seen = _statements(store)
    store.turns.add(second)
    store.db._writer.set_trace_callback(None)
    assert not [q for q in seen if q.startswith("SELECT seq FROM turns")]  # no base lookup
    with store.db.read() as c:
        base, base_len, tail = c.execute(
            "SELECT prompt_base, prompt_base_len, prompt_tail FROM turns WHERE turn_id = ?", (second.turn_id,)
        ).fetchone()
        first_seq = c.execute("SELECT seq FROM turns WHERE turn_id = ?", (first.turn_id,)).fetchone()[0]
    assert (base, base_len) == (first_seq, 303)
    assert np.frombuffer(tail, dtype=np.int32).tolist() == bridge
    store.close()
    again = Store(db_path)  # no caches: rebuilt from the rows
    assert list(again.turns.get(second.turn_id).prompt_ids) == list(range(100, 400)) + [7, 8, 9] + bridge
    again.close()


def test_a_prompt_that_is_not_a_splice_still_finds_its_base(db_path):
    store = Store(db_path)
    first = build_turn("s", 0, list(range(100, 400)), [7, 8, 9])
    store.turns.add(first, session_fields={})
    copy = list(range(100, 400)) + [7, 8, 9, 11]  # the same ids, not the parent's chain
    second = build_turn("s", 1, copy, [21], parent=first.turn_id)
    seen = _statements(store)
    store.turns.add(second)
    store.db._writer.set_trace_callback(None)
    assert [q for q in seen if q.startswith("SELECT seq FROM turns")]  # looked it up
    with store.db.read() as c:
        base_len = c.execute("SELECT prompt_base_len FROM turns WHERE turn_id = ?", (second.turn_id,)).fetchone()[0]
    assert base_len == 303
    store.close()
    again = Store(db_path)
    assert list(again.turns.get(second.turn_id).prompt_ids) == copy
    again.close()


def test_a_parent_in_another_session_is_not_a_base(db_path):
    """A request may continue another session's turn under its own session id: its prompt is
    stored whole, so each session decodes from its own rows."""
    store = Store(db_path)
    first = build_turn("a", 0, list(range(100, 400)), [7, 8, 9])
    store.turns.add(first, session_fields={})
    prompt, out = store.turns.ids(first.turn_id)
    other = build_turn("b", 0, [], [21], parent=first.turn_id)
    other.prompt_ids = id_chain.join(prompt, out, [11])
    store.turns.add(other, session_fields={})
    with store.db.read() as c:
        base = c.execute("SELECT prompt_base FROM turns WHERE turn_id = ?", (other.turn_id,)).fetchone()[0]
    assert base is None
    store.close()
    again = Store(db_path)
    assert list(again.turns.get(other.turn_id).prompt_ids) == list(range(100, 400)) + [7, 8, 9, 11]
    again.close()
