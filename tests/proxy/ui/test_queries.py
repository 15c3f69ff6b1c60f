"""The sessions table's query against a real store: every filter, alone and combined, paged to
the end, gives exactly the sessions a plain Python filter over the records written picks, newest
first; filters that read turn rows (engine, versions) look through a bounded window per page
and still reach every match; the role filter reads indexes only."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from proxy.store import ImageRef, Store, StoredImage, TurnRecord
from proxy.ui import queries
from proxy.ui.queries import SessionFilter, list_sessions


def _turn(sid: str, idx: int, versions: list[int], *, fork: str | None, engine: str, images=()) -> TurnRecord:
    n = len(versions)
    return TurnRecord(
        f"{sid}-t{idx}", sid, idx, f"{sid}-t{idx - 1}" if idx else None, list(range(10, 30)), list(range(40, 40 + n)), [-0.5] * n,
        versions, [-0.5] * n, versions, idx > 0 and fork is None, fork, "stop", 1000.0 + idx, {"engine_id": engine}, False,
        "chat", f"r-{sid}-{idx}", images=images,
    )  # fmt: skip


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    rng = random.Random(7)
    clock = itertools.count(1_000_000.0, 1.5)
    s = Store(str(tmp_path_factory.mktemp("q") / "s.sqlite"), clock=lambda: next(clock))
    truth = []
    image = StoredImage("ab" * 32, "image/png", 4, 4, (1, 2, 2), b"\x89PNG")
    for k in range(60):
        sid = f"sess-{k:03d}"
        group = f"g{k % 4}" if k % 3 else None
        v0 = k // 10
        turns = [[v0] * 5, [v0, v0 + 1, v0 + 1]] if k % 5 == 0 else [[v0] * 4]
        # episode roles: a sub-agent's first call, a compacted restart with no main turn left,
        # a side call (title) after the conversation
        roles = ["subagent" if k % 11 == 0 else "compacted" if k % 13 == 5 else "main"] + ["main"] * (len(turns) - 1)
        if k % 4 == 2:
            turns.append([v0] * 2)
            roles.append("auxiliary")
        fork = rng.choice(["tools_changed", "history_edited"]) if k % 7 == 0 and len(turns) > 1 else None
        engine = "http://engine-a:1" if k % 2 else "http://engine-b:2"
        has_image = k % 9 == 0
        s.sessions.upsert(sid, group_id=group)
        for i, v in enumerate(turns):
            refs = (ImageRef(image.hash, 3, 4, (1, 2, 2)),) if has_image and i == 0 else ()
            turn = dataclasses.replace(_turn(sid, i, v, fork=fork if 0 < i < 2 else None, engine=engine, images=refs), role=roles[i])
            s.turns.add(turn, new_images=[image] if refs else ())
        rewarded = k % 4 == 1
        if rewarded:
            s.sessions.set_reward(sid, 1.0)
        created = s.sessions.get(sid).created_at
        truth.append({"sid": sid, "group": group, "versions": {x for v in turns for x in v}, "fork": fork, "engine": engine,
                      "images": has_image, "rewarded": rewarded, "roles": set(roles), "created": created, "turns": len(turns),
                      "tokens": sum(map(len, turns))})  # fmt: skip
    yield s, truth
    s.close()


def _expected(truth, f: SessionFilter) -> list[str]:
    def keep(t) -> bool:
        if f.group_id is not None and t["group"] != f.group_id:
            return False
        if f.role is not None and f.role not in t["roles"]:
            return False
        if f.search and not t["sid"].startswith(f.search):
            return False
        if f.rewarded is not None and t["rewarded"] != f.rewarded:
            return False
        if f.fork_reason == "*" and t["fork"] is None or f.fork_reason not in (None, "*") and t["fork"] != f.fork_reason:
            return False
        if f.has_images is not None and t["images"] != f.has_images:
            return False
        if f.engine and f.engine not in t["engine"]:
            return False
        lo = -(2**31) if f.version_min is None else f.version_min
        hi = 2**31 if f.version_max is None else f.version_max
        return any(lo <= v <= hi for v in t["versions"])

    return [t["sid"] for t in sorted(truth, key=lambda t: t["created"], reverse=True) if keep(t)]


def _paged(s: Store, f: SessionFilter, limit: int) -> tuple[list[str], list[dict]]:
    got, pages, cursor = [], [], None
    while True:
        page = list_sessions(s.db, f, version=9, cursor=cursor, limit=limit)
        pages.append(page)
        got += [r["session_id"] for r in page["data"]]
        cursor = page["next_cursor"]
        if not page["has_more"]:
            return got, pages


FILTERS = [
    SessionFilter(),
    SessionFilter(group_id="g1"),
    SessionFilter(rewarded=True),
    SessionFilter(rewarded=False, group_id="g2"),
    SessionFilter(fork_reason="*"),
    SessionFilter(fork_reason="tools_changed"),
    SessionFilter(has_images=True),
    SessionFilter(has_images=False, rewarded=True),
    SessionFilter(engine="engine-a"),
    SessionFilter(version_min=3, version_max=3),
    SessionFilter(version_max=0),
    SessionFilter(version_min=5, engine="engine-b", rewarded=False),
    SessionFilter(search="sess-04"),
    SessionFilter(role="main"),
    SessionFilter(role="auxiliary"),
    SessionFilter(role="subagent"),
    SessionFilter(role="compacted"),
    SessionFilter(role="auxiliary", rewarded=False, engine="engine-a"),
    SessionFilter(role="main", fork_reason="*"),
]


@pytest.mark.parametrize("f", FILTERS, ids=repr)
@pytest.mark.parametrize("limit", [7, 200])
def test_every_filter_pages_to_exactly_the_matching_sessions(store, f, limit, monkeypatch):
    s, truth = store
    monkeypatch.setattr(queries, "SCAN", 11)  # windows smaller than the store: scanned filters page on
    got, pages = _paged(s, f, limit)
    assert got == _expected(truth, f)
    assert all(len(p["data"]) <= limit for p in pages)


def test_the_columns_are_the_recorded_figures(store):
    s, truth = store
    rows = {r["session_id"]: r for r in list_sessions(s.db, SessionFilter(), version=9, limit=200)["data"]}
    for t in truth:
        r = rows[t["sid"]]
        assert (r["turns"], r["tokens"], r["forks"], r["has_images"]) == (t["turns"], t["tokens"], int(t["fork"] is not None), t["images"])
        assert r["staleness"] == 9 - min(t["versions"])
        assert (r["reward"] is not None) == t["rewarded"]
        assert r["roles"] == [x for x in ("main", "auxiliary", "subagent", "compacted") if x in t["roles"]]
    assert queries.fork_reasons(s.db) == sorted({t["fork"] for t in truth if t["fork"]})
    assert queries.engines(s.db) == ["http://engine-a:1", "http://engine-b:2"]


def test_a_cursor_from_elsewhere_is_refused(store):
    s, _ = store
    for bad in ("zz", "nan:1", "1.0:x"):
        with pytest.raises(ValueError):
            list_sessions(s.db, SessionFilter(), version=0, cursor=bad)


def _plan(s: Store, f: SessionFilter) -> list[str]:
    where, args = queries._where(f)
    sql = f"SELECT s.session_id FROM sessions s WHERE {' AND '.join(where)} ORDER BY s.created_at DESC, s.rowid DESC LIMIT 5"
    with s.db.read() as c:
        return [row[3] for row in c.execute("EXPLAIN QUERY PLAN " + sql, args)]


@pytest.mark.parametrize(
    "f",
    [SessionFilter(role="main"), SessionFilter(role="auxiliary"), SessionFilter(fork_reason="*"), SessionFilter(fork_reason="tools_changed"),
     SessionFilter(has_images=True), SessionFilter(has_images=False)],
    ids=repr,
)  # fmt: skip
def test_the_indexed_filters_walk_sessions_newest_first(store, f):
    """A page stops after its rows: the walk is the created_at index, never a sort of every
    match (with many matches that sort computes every match's columns: seconds at 100k)."""
    plan = _plan(store[0], f)
    assert plan[0] == "SCAN s USING INDEX sessions_created", plan
    assert not any("TEMP B-TREE" in p for p in plan), plan


@pytest.mark.parametrize("role", ["main", "auxiliary", "subagent"])
def test_the_role_filter_reads_indexes_only(store, role):
    """Per candidate session, index probes only: never the wide turn rows."""
    s, truth = store
    assert {r for t in truth for r in t["roles"]} == {"main", "auxiliary", "subagent", "compacted"}
    plan = _plan(s, SessionFilter(role=role))
    turn_steps = [p for p in plan if " t " in f" {p} " or "turns" in p]
    assert turn_steps and all(p.startswith("SEARCH t USING COVERING INDEX") for p in turn_steps), plan
