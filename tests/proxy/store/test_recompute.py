"""R2: owed-token selection and proximal recompute by absolute position."""

from __future__ import annotations

import asyncio
import logging

from proxy.session.recompute import recompute_owed, recompute_owed_report


class FakePool:
    """log pi_V(token at absolute position p) = -(p + 1) / 8 - V / 1024: distinct per position and version."""

    def __init__(self, version: int, fail_for: set[str] = frozenset()):
        self.version = version
        self.fail_for = fail_for
        self.calls: list[tuple[int, int, str]] = []

    async def prefill_logprobs(self, *, input_ids: list[int], start: int, session_id: str) -> list[float]:
        self.calls.append((len(input_ids), start, session_id))
        await asyncio.sleep(0)
        if session_id in self.fail_for:
            raise RuntimeError("engine down")
        return [self.value(p) for p in range(start, len(input_ids))]

    def value(self, position: int) -> float:
        return -(position + 1) / 8 - self.version / 1024


def test_owed_recompute_selection(store, make_turn):
    store.sessions.upsert("live")
    a = make_turn("live", 0, [1], [2, 3, 4], version=[1, 2, 2])
    b = make_turn("live", 1, [1, 2, 3, 4, 5], [6], version=2)
    b.proximal_logprobs_t, b.proximal_versions = [-0.5], [3]  # already recomputed (R1)
    c = make_turn("live", 2, [7], [8], version=3)
    for t in (a, b, c):
        store.turns.add(t)
    store.sessions.upsert("acked")
    store.turns.add(make_turn("acked", 0, [1], [2], version=2))
    store.sessions.set_reward("acked", 1.0)
    store.pool.ack(store.pool.pull(5, 10.0)[0])
    store.sessions.upsert("leased")
    store.turns.add(make_turn("leased", 0, [1], [2], version=2))
    store.sessions.set_reward("leased", 1.0)
    store.pool.pull(5, 10.0)  # leased but not acked: still owed
    assert [t.turn_id for t in store.turns.owed(3)] == ["live-t0", "leased-t0"]
    assert store.turns.owed_count(3) == 2
    assert [t.turn_id for t in store.turns.owed(2)] == ["live-t0"]
    assert [t.turn_id for t in store.turns.owed(4)] == ["live-t2"]
    assert store.turns.owed(9) == []


def test_recompute_sets_values_by_absolute_position(store, make_turn):
    store.sessions.upsert("s")
    t0 = make_turn("s", 0, [1, 2, 3], [4, 5, 6, 7], version=[1, 2, 2, 3])
    t0.proximal_logprobs_t[2], t0.proximal_versions[2] = -0.75, 3  # already had its value
    t1 = make_turn("s", 1, t0.full_ids + [8, 9], [10, 11], version=2)
    store.turns.add(t0)
    store.turns.add(t1)
    pool = FakePool(version=3)
    assert asyncio.run(recompute_owed(store, pool, 3)) == 1 + 2
    got0, got1 = store.turns.list("s")
    # t0: output token i sits at absolute position 3 + i
    assert got0.proximal_logprobs_t == [t0.output_logprobs[0], pool.value(4), -0.75, t0.output_logprobs[3]]
    assert got0.proximal_versions == [1, 3, 3, 3]
    assert got1.proximal_logprobs_t == [pool.value(9), pool.value(10)]
    assert got1.proximal_versions == [3, 3]
    for got, t in ((got0, t0), (got1, t1)):  # behaviour arrays untouched
        assert got.output_logprobs == t.output_logprobs and got.versions == t.versions and got.prompt_ids == t.prompt_ids
    # one prefill per leaf: t1's prompt holds t0 verbatim, so t1 is the leaf of both, read
    # from t0's first owed position (3 + 1) on
    assert pool.calls == [(11, 4, "s")]
    assert store.turns.owed(3) == []
    assert asyncio.run(recompute_owed(store, pool, 3)) == 0  # nothing owed twice


def test_engine_error_leaves_turn_and_continues(store, make_turn, caplog):
    for sid in ("ok", "bad"):
        store.sessions.upsert(sid)
        store.turns.add(make_turn(sid, 0, [1, 2], [3, 4], version=0))
    pool = FakePool(version=1, fail_for={"bad"})
    with caplog.at_level(logging.WARNING, logger="proxy.session.recompute"):
        report = asyncio.run(recompute_owed_report(store, pool, 1))
    assert (report.turns, report.tokens, report.failures) == (2, 2, 1)
    assert "engine down" in caplog.text
    bad = store.turns.get("bad-t0")
    assert bad.proximal_versions == [0, 0] and bad.proximal_logprobs_t == bad.output_logprobs
    assert store.turns.get("ok-t0").proximal_versions == [1, 1]
    assert [t.turn_id for t in store.turns.owed(1)] == ["bad-t0"]  # retried next time


def test_wrong_length_answer_is_a_failure(store, make_turn):
    store.sessions.upsert("s")
    store.turns.add(make_turn("s", 0, [1], [2, 3], version=0))

    class Short(FakePool):
        async def prefill_logprobs(self, *, input_ids, start, session_id):
            return [-1.0]

    report = asyncio.run(recompute_owed_report(store, Short(1), 1))
    assert report.failures == 1 and report.tokens == 0
    assert store.turns.get("s-t0").proximal_versions == [0, 0]


def test_session_id_for_routes_calls(store, make_turn):
    store.sessions.upsert("s")
    store.turns.add(make_turn("s", 0, [1], [2], version=0))
    pool = FakePool(1)
    asyncio.run(recompute_owed(store, pool, 1, session_id_for=lambda t: "route-" + t.session_id))
    assert pool.calls == [(2, 1, "route-s")]


# -- per session leaf (docs/design.md section 4) -------------------------------------------------


def test_one_prefill_per_leaf_rollback_is_its_own_leaf(store, make_turn):
    """t0 <- t1 <- t2 is one branch; t3 rolls back to t0 with another prompt: two leaves. t0 lies
    on both; the longer leaf settles it, so the other is read only from its own first owed token."""
    store.sessions.upsert("s")
    t0 = make_turn("s", 0, [1, 2], [3, 4], version=0)
    t1 = make_turn("s", 1, t0.full_ids + [5], [6, 7], version=0)
    t2 = make_turn("s", 2, t1.full_ids + [8], [9], version=[0])
    t3 = make_turn("s", 3, t0.full_ids + [50], [51, 52], version=0)
    for t in (t0, t1, t2, t3):
        store.turns.add(t)
    pool = FakePool(version=1)
    report = asyncio.run(recompute_owed_report(store, pool, 1))
    assert sorted(pool.calls) == sorted([(len(t2.full_ids), 2, "s"), (len(t3.full_ids), len(t3.prompt_ids), "s")])
    assert (report.prefills, report.turns, report.tokens, report.failures) == (2, 4, 7, 0)
    for got in store.turns.list("s"):
        n = len(got.prompt_ids)
        assert got.proximal_versions == [1] * len(got.output_ids)
        assert got.proximal_logprobs_t == [pool.value(n + i) for i in range(len(got.output_ids))]


def test_abandoned_turn_owes_nothing_but_still_carries_a_path(store, make_turn):
    store.sessions.upsert("s")
    t0 = make_turn("s", 0, [1, 2], [3], version=0)
    t1 = make_turn("s", 1, t0.full_ids + [4], [5, 6], version=0)
    store.turns.add(t0)
    store.turns.add(t1)
    store.turns.abandon(t1.turn_id)
    pool = FakePool(version=1)
    assert asyncio.run(recompute_owed(store, pool, 1)) == 1
    assert pool.calls == [(len(t1.full_ids), 2, "s")]  # the longest stored path holding t0
    assert store.turns.get(t1.turn_id).proximal_versions == [0, 0]


def test_stale_leaf_is_not_recomputed(store, make_turn):
    store.sessions.upsert("s")
    t0 = make_turn("s", 0, [1, 2], [3], version=0)
    t1 = make_turn("s", 1, t0.full_ids + [4], [5, 6], version=1)
    store.turns.add(t0)
    store.turns.add(t1)
    pool = FakePool(version=2)
    report = asyncio.run(recompute_owed_report(store, pool, 2, min_version=1))
    assert pool.calls == [] and report.stale_tokens == 2 and report.tokens == 0
