"""Episode roles in the store: recorded per turn, migrated into older stores, and what sample
assembly does with them (one sample per segment; auxiliary calls left out unless asked)."""

from __future__ import annotations

import sqlite3

import numpy as np

from proxy.store import SCHEMA_VERSION, Store
from proxy.store.samples import assemble_samples
from tests.proxy.store.conftest import build_turn


def _with_role(turn, role):
    turn.role = role
    return turn


def test_a_schema_4_store_is_migrated_and_its_turns_are_main(tmp_path):
    path = str(tmp_path / "old.sqlite")
    with Store(path) as s:
        s.sessions.upsert("a")
        s.turns.add(build_turn("a", 0, [1, 2, 3], [4, 5]))
    # the file as Splice 4 wrote it: no role column, user_version 4
    c = sqlite3.connect(path)
    c.execute("DROP INDEX turns_role")
    c.execute("ALTER TABLE turns DROP COLUMN role")
    c.execute("PRAGMA user_version=4")
    c.commit()
    assert "role" not in [r[1] for r in c.execute("PRAGMA table_info(turns)")]
    c.close()
    with Store(path) as s:
        (turn,) = s.turns.list("a")
        assert turn.role == "main" and turn.output_ids == [4, 5]
        s.turns.add(_with_role(build_turn("a", 1, [1, 2, 3, 4, 5, 6], [7]), "subagent"))
        assert [t.role for t in s.turns.list("a")] == ["main", "subagent"]
    c = sqlite3.connect(path)
    assert c.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert c.execute("SELECT 1 FROM sqlite_master WHERE type = 'index' AND name = 'turns_role'").fetchone() is not None
    c.close()


def test_a_sample_per_segment_and_no_auxiliary_by_default(tmp_path):
    with Store(str(tmp_path / "s.sqlite")) as s:
        s.sessions.upsert("e")
        turns = [
            _with_role(build_turn("e", 0, [9, 9, 9], [8]), "auxiliary"),  # a title call
            build_turn("e", 1, [1, 2, 3], [4, 5]),  # main
            _with_role(build_turn("e", 2, [1, 2, 3, 4, 5, 6], [7]), "subagent"),  # extends main's ids, other role
            build_turn("e", 3, [1, 2, 3, 4, 5, 6], [8, 8]),  # main continues
            _with_role(build_turn("e", 4, [20, 21], [22]), "compacted"),
        ]
        for t in turns:
            s.turns.add(t)
        session = s.sessions.get("e")
        with s.db.read() as c:
            samples = assemble_samples(session, s.turns.iter_tokens(c, "e"))
            with_aux = assemble_samples(session, s.turns.iter_tokens(c, "e"), train_auxiliary=True)
    assert [(x.role, x.turn_ids) for x in samples] == [("main", ["e-t1", "e-t3"]), ("subagent", ["e-t2"]), ("compacted", ["e-t4"])]
    assert np.array_equal(samples[0].input_ids, [1, 2, 3, 4, 5, 6, 8, 8])
    assert all(t.role == x.role for x in samples for t in x.turns)
    assert [x.role for x in with_aux] == ["auxiliary", "main", "subagent", "compacted"]
    assert with_aux[0].header()["role"] == "auxiliary" and with_aux[0].trainable


def test_the_pull_leaves_side_calls_out_unless_they_are_all_the_episode_has(tmp_path):
    with Store(str(tmp_path / "s.sqlite")) as s:
        for sid in ("with-main", "only-aux"):
            s.sessions.upsert(sid)
        s.turns.add(_with_role(build_turn("with-main", 0, [9, 9], [8]), "auxiliary"))
        s.turns.add(build_turn("with-main", 1, [1, 2], [3]))
        # a structured-output task without tools: every call looks like a side call
        s.turns.add(_with_role(build_turn("only-aux", 0, [5, 6], [7]), "auxiliary"))
        s.sessions.set_reward("with-main", 1.0)
        s.sessions.set_reward("only-aux", 0.0)
        _lease, samples = s.pool.pull(64, 60.0)
    assert sorted((x["session_id"], x["role"]) for x in samples) == [("only-aux", "auxiliary"), ("with-main", "main")]


def test_role_of_answers_committed_turns_only_from_memory_or_file(tmp_path):
    """``role_of`` keeps roles in memory once committed: a turn whose write failed has none,
    and a fresh store on the same file reads the same roles from disk."""
    from proxy.store.errors import Conflict

    path = str(tmp_path / "roles.sqlite")
    with Store(path) as s:
        s.sessions.upsert("a")
        s.turns.add(_with_role(build_turn("a", 0, [1, 2, 3], [4, 5]), "subagent"))
        clash = _with_role(build_turn("a", 0, [1, 2, 3], [4, 5], turn_id="a-other"), "auxiliary")
        try:
            s.turns.add(clash)  # same (session, index): rolled back
        except Conflict:
            pass
        else:
            raise AssertionError("a second turn 0 must not be stored")
        assert s.turns.role_of("a-t0") == "subagent"
        assert s.turns.role_of("a-other") is None
        assert s.turns.role_of("missing") is None
    with Store(path) as s:
        assert s.turns.role_of("a-t0") == "subagent"
        assert s.turns.role_of("a-other") is None
