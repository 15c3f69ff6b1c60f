"""Pull / lease / ack: samples are never lost, never handed out twice, groups never split."""

from __future__ import annotations

import pytest

from proxy.store import Conflict, NotFound, Store


def rewarded(store, make_turn, session_id, *, reward=1.0, group_id=None, group_size=None, turns=1, clock=None):
    store.sessions.upsert(session_id, group_id=group_id, group_size=group_size)
    prompt = [1, 2]
    for k in range(turns):
        t = make_turn(session_id, k, prompt, [10 + k])
        store.turns.add(t)
        prompt = t.full_ids + [5]
    if clock is not None:
        clock.advance(1)
    return store.sessions.set_reward(session_id, reward)


def sessions_of(samples):
    return [s["session_id"] for s in samples]


def test_pull_hands_out_once_until_expiry(store, make_turn, clock):
    assert store.pool.pull(8, 30.0) == (None, [])
    rewarded(store, make_turn, "a", reward=0.25, turns=2, clock=clock)
    store.sessions.upsert("open")  # no reward: never handed out
    store.turns.add(make_turn("open", 0, [1], [2]))
    lease, samples = store.pool.pull(8, 30.0)
    assert lease and sessions_of(samples) == ["a"]
    s = samples[0]
    assert s["reward"] == 0.25 and s["input_ids"] == [1, 2, 10, 5, 11] and s["loss_mask"] == [0, 0, 1, 0, 1]
    assert store.pool.pull(8, 30.0) == (None, [])
    assert store.stats()["sessions_leased"] == 1
    clock.advance(31)
    lease2, again = store.pool.pull(8, 30.0)
    assert lease2 != lease and again == samples
    with pytest.raises(Conflict, match="expired"):
        store.pool.ack(lease)
    store.pool.ack(lease2)
    store.pool.ack(lease2)  # a retried ack is harmless
    clock.advance(1000)
    assert store.pool.pull(8, 30.0) == (None, [])
    with pytest.raises(NotFound):
        store.pool.ack("lease_unknown")
    st = store.stats()
    assert st["sessions_acked"] == 1 and st["sessions_leased"] == 0 and st["rewards_pending"] == 0


def test_ack_just_after_deadline_is_refused_and_samples_return(store, make_turn, clock):
    rewarded(store, make_turn, "a")
    lease, _ = store.pool.pull(8, 5.0)
    clock.advance(5.0)
    with pytest.raises(Conflict):
        store.pool.ack(lease)
    assert sessions_of(store.pool.pull(8, 5.0)[1]) == ["a"]


def test_max_samples_and_order(store, make_turn, clock):
    for name in ("s1", "s2", "s3"):
        rewarded(store, make_turn, name, clock=clock)
    lease1, first = store.pool.pull(2, 30.0)
    lease2, second = store.pool.pull(2, 30.0)
    assert sessions_of(first) == ["s1", "s2"] and sessions_of(second) == ["s3"]
    assert store.pool.pull(2, 30.0) == (None, [])
    store.pool.ack(lease1)
    store.pool.ack(lease2)
    assert store.stats()["sessions_acked"] == 3


def test_groups_only_whole_and_complete(store, make_turn, clock):
    rewarded(store, make_turn, "g-0", group_id="g", group_size=3, clock=clock)
    rewarded(store, make_turn, "g-1", group_id="g", group_size=3, clock=clock)
    store.sessions.upsert("g-2", group_id="g", group_size=3)
    store.turns.add(make_turn("g-2", 0, [1], [2]))
    rewarded(store, make_turn, "solo", clock=clock)
    lease, samples = store.pool.pull(10, 30.0)
    assert sessions_of(samples) == ["solo"]  # the group is incomplete
    clock.advance(1)
    store.sessions.set_reward("g-2", 0.0)
    _, samples = store.pool.pull(2, 30.0)  # does not fit, but is first in the lease: handed out whole anyway
    assert sorted(sessions_of(samples)) == ["g-0", "g-1", "g-2"]
    assert all(s["group_id"] == "g" for s in samples)


def test_group_not_split_when_it_does_not_fit_behind_others(store, make_turn, clock):
    rewarded(store, make_turn, "solo", clock=clock)
    for k in range(2):
        rewarded(store, make_turn, f"g-{k}", group_id="g", group_size=2, clock=clock)
    rewarded(store, make_turn, "late", clock=clock)
    _, samples = store.pool.pull(2, 30.0)
    assert sessions_of(samples) == ["solo", "late"]  # the group (2) does not fit after "solo"
    _, samples = store.pool.pull(2, 30.0)
    assert sorted(sessions_of(samples)) == ["g-0", "g-1"]


def test_forked_session_samples_stay_together(store, make_turn, clock):
    store.sessions.upsert("f")
    store.turns.add(make_turn("f", 0, [1, 2], [3]))
    store.turns.add(make_turn("f", 1, [9, 9], [4]))  # fork: second sample
    clock.advance(1)
    store.sessions.set_reward("f", 1.0)
    rewarded(store, make_turn, "x", clock=clock)
    _, samples = store.pool.pull(1, 30.0)  # first unit is larger than max_samples: whole anyway
    assert [s["sample_id"] for s in samples] == ["f:0", "f:1"]
    _, samples = store.pool.pull(1, 30.0)
    assert sessions_of(samples) == ["x"]


def test_rewarded_session_without_turns_is_retired(store, clock):
    store.sessions.upsert("empty")
    store.sessions.set_reward("empty", 1.0)
    assert store.pool.pull(4, 30.0) == (None, [])
    assert store.sessions.get("empty").acked


def test_leases_persist_across_reopen(db_path, make_turn, clock):
    store = Store(db_path, clock=clock)
    rewarded(store, make_turn, "a", clock=clock)
    rewarded(store, make_turn, "b", clock=clock)
    lease_a, _ = store.pool.pull(1, 60.0)
    lease_b, _ = store.pool.pull(1, 60.0)
    store.pool.ack(lease_a)
    store.close()
    store = Store(db_path, clock=clock)
    assert store.pool.pull(8, 60.0) == (None, [])  # a acked, b still leased
    store.pool.ack(lease_b)
    store.close()
    store = Store(db_path, clock=clock)
    clock.advance(120)
    assert store.pool.pull(8, 60.0) == (None, [])
    assert store.stats()["sessions_acked"] == 2
    store.close()


def test_expired_lease_survives_restart_then_returns(db_path, make_turn, clock):
    store = Store(db_path, clock=clock)
    rewarded(store, make_turn, "a", clock=clock)
    lease, first = store.pool.pull(1, 10.0)
    store.close()
    clock.advance(11)
    store = Store(db_path, clock=clock)
    lease2, again = store.pool.pull(1, 10.0)
    assert again == first and lease2 != lease
    store.close()


def test_pull_reflects_recomputed_proximal_values(store, make_turn, clock):
    store.sessions.upsert("a")
    t = make_turn("a", 0, [1], [2, 3], version=4)
    store.turns.add(t)
    store.sessions.set_reward("a", 1.0)
    store.turns.update_proximal(t.turn_id, [-0.5, t.output_logprobs[1]], [5, 4])
    (s,) = store.pool.pull(1, 10.0)[1]
    assert s["proximal_logprobs_t"] == [0.0, -0.5, t.output_logprobs[1]]
    assert s["proximal_versions"] == [-1, 5, 4]
