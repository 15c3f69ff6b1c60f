"""Sessions, turns, ids, fingerprints and stored responses."""

from __future__ import annotations

import orjson
import pytest

from proxy.store import Conflict, NotFound, Store


def test_session_upsert_and_reward(store, clock):
    s = store.upsert_session("s1", group_id="g", group_size=4, metadata={"a": 1})
    assert (s.session_id, s.group_id, s.group_size, s.reward, s.closed, s.metadata) == ("s1", "g", 4, None, False, {"a": 1})
    assert s.created_at == clock.t
    s = store.upsert_session("s1", metadata={"b": 2})
    assert s.metadata == {"a": 1, "b": 2} and s.group_id == "g"
    with pytest.raises(Conflict):
        store.upsert_session("s1", group_id="other")
    with pytest.raises(Conflict):
        store.upsert_session("s1", group_size=8)
    with pytest.raises(ValueError):
        store.upsert_session("s2", group_size=0)
    assert store.get_session("nope") is None
    r = store.set_reward("s1", 0.5)
    assert r.reward == 0.5 and r.closed and r.rewarded_at == clock.t
    with pytest.raises(Conflict, match="already has a reward"):
        store.set_reward("s1", 1.0)
    assert store.get_session("s1").reward == 0.5
    with pytest.raises(NotFound):
        store.set_reward("nope", 1.0)
    store.upsert_session("s3")
    with pytest.raises(ValueError):
        store.set_reward("s3", float("nan"))


def test_turns_round_trip_in_index_order(store, make_turn):
    store.upsert_session("s")
    t0 = make_turn("s", 0, [1, 2, 3], [4, 5])
    t1 = make_turn("s", 1, [1, 2, 3, 4, 5, 6], [7], version=1, parent="s-t0")
    t2 = make_turn("s", 2, [1, 2, 3, 4, 5, 6, 7, 8], [9, 10], version=[1, 2], parent="s-t1")
    for t in (t1, t0, t2):  # stored out of order; bases must still resolve
        store.add_turn(t)
    assert store.list_turns("s") == [t0, t1, t2]
    assert store.get_turn("s-t2") == t2
    assert store.get_turn("missing") is None
    assert store.list_turns("unknown") == []


def test_add_turn_rejections(store, make_turn):
    with pytest.raises(NotFound):
        store.add_turn(make_turn("nosession", 0, [1], [2]))
    store.upsert_session("s")
    store.add_turn(make_turn("s", 0, [1], [2]))
    with pytest.raises(Conflict):
        store.add_turn(make_turn("s", 1, [1], [2], turn_id="s-t0"))
    with pytest.raises(Conflict):
        store.add_turn(make_turn("s", 0, [1], [2], turn_id="other"))
    bad = make_turn("s", 1, [1], [2, 3])
    bad.versions = [0]
    with pytest.raises(ValueError):
        store.add_turn(bad)
    bad = make_turn("s", 1, [1], [2])
    bad.output_logprobs = [float("-inf")]
    bad.proximal_logprobs_t = [float("-inf")]
    with pytest.raises(ValueError):
        store.add_turn(bad)
    with pytest.raises(ValueError):
        store.add_turn(make_turn("s", 1, [2**40], [2]))
    store.set_reward("s", 1.0)
    with pytest.raises(Conflict, match="closed"):
        store.add_turn(make_turn("s", 1, [1], [2]))
    assert len(store.list_turns("s")) == 1


def test_prompt_delta_survives_forks_and_cold_reads(db_path, make_turn):
    """Prompts are stored as deltas on earlier turns; every shape must rebuild exactly, cache or not."""
    store = Store(db_path)
    store.upsert_session("s")
    system = list(range(100, 140))
    turns = [make_turn("s", 0, system + [1], [2, 3])]
    turns.append(make_turn("s", 1, turns[0].full_ids + [4], [5], parent="s-t0"))  # spliced
    turns.append(make_turn("s", 2, system + [9, 9], [6], parent="s-t1"))  # fork sharing the system prompt
    turns.append(make_turn("s", 3, turns[1].full_ids[:-2], [7]))  # rollback: prefix of an older turn
    turns.append(make_turn("s", 4, [8] * 3, [1]))  # shares nothing
    turns.append(make_turn("s", 5, turns[4].full_ids + list(range(50)), [2], parent="s-t4"))
    for t in turns:
        store.add_turn(t)
    assert store.list_turns("s") == turns
    store.close()
    cold = Store(db_path)
    assert cold.get_turn("s-t5") == turns[5]
    assert cold.get_turn("s-t3") == turns[3]
    assert cold.list_turns("s") == turns
    cold.close()


def test_proximal_update(store, make_turn):
    store.upsert_session("s")
    t = make_turn("s", 0, [1], [2, 3, 4], version=[3, 3, 4])
    store.add_turn(t)
    store.update_proximal("s-t0", [-0.5, -0.25, t.output_logprobs[2]], [4, 4, 4])
    got = store.get_turn("s-t0")
    assert got.proximal_logprobs_t == [-0.5, -0.25, t.output_logprobs[2]]
    assert got.proximal_versions == [4, 4, 4]
    assert got.output_logprobs == t.output_logprobs and got.versions == [3, 3, 4]
    with pytest.raises(ValueError):
        store.update_proximal("s-t0", [-0.5], [4])
    with pytest.raises(NotFound):
        store.update_proximal("nope", [], [])


def test_item_ids_and_fingerprints(store, make_turn):
    store.upsert_session("s")
    t0, t1 = make_turn("s", 0, [1], [2]), make_turn("s", 1, [1, 2, 3], [4])
    store.add_turn(t0)
    store.add_turn(t1)
    store.add_item_ids("s-t0", ["msg_a", "rs_a", "fc_a", "call_a"])
    store.add_item_ids("s-t0", ["msg_a"])  # idempotent
    with pytest.raises(Conflict):
        store.add_item_ids("s-t1", ["msg_a"])
    with pytest.raises(NotFound):
        store.add_item_ids("nope", ["msg_b"])
    assert store.find_turn_by_item_id("call_a") == t0
    assert store.find_turn_by_item_id("resp_s-t1") == t1  # the response id is registered by add_turn
    assert store.find_turn_by_item_id("msg_zzz") is None
    store.put_fingerprint("fp1", "s-t0")
    assert store.find_turn_by_fingerprint("fp1") == t0
    store.put_fingerprint("fp1", "s-t1")
    assert store.find_turn_by_fingerprint("fp1") == t1
    assert store.find_turn_by_fingerprint("fp2") is None
    with pytest.raises(NotFound):
        store.put_fingerprint("fp3", "nope")


def test_responses_delta_chain(db_path):
    store = Store(db_path)
    empty_bytes = store.stats()["db_bytes"]
    convs, items = [], []
    for k in range(40):  # longer than the delta-chain bound, so full copies are interleaved
        items.append({"role": "user", "content": f"message {k} " + "x" * 200})
        conv = orjson.dumps(items)
        convs.append(conv)
        store.put_response(f"resp_{k}", "s", f"t{k}", orjson.dumps({"id": f"resp_{k}"}), conv)
    store.put_response("resp_other", "s2", None, b"{}", b"[]")
    with pytest.raises(Conflict):
        store.put_response("resp_0", "s", None, b"", b"")
    for k in (0, 17, 39):
        assert store.get_response(f"resp_{k}") == (orjson.dumps({"id": f"resp_{k}"}), convs[k])
    assert store.get_response("resp_other") == (b"{}", b"[]")
    assert store.get_response("nope") is None
    total = sum(len(c) for c in convs)
    store.close()
    cold = Store(db_path)
    for k in range(40):
        assert cold.get_response(f"resp_{k}")[1] == convs[k]
    assert cold.stats()["db_bytes"] - empty_bytes < total / 10  # quadratic history stored in ~linear space
    cold.close()


def test_concurrent_threads(store, make_turn):
    """The app calls the store from the event loop and from worker threads at once."""
    import threading

    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            sid = f"w{w}"
            store.upsert_session(sid)
            prompt = [w, w]
            for k in range(15):
                t = make_turn(sid, k, prompt, [100 + k, 200 + k])
                store.add_turn(t)
                assert store.get_turn(t.turn_id) == t
                store.put_fingerprint(f"{sid}-{k}", t.turn_id)
                prompt = t.full_ids + [7]
            store.set_reward(sid, float(w))
            store.stats()
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    lease, samples = store.pull(100, 10.0)
    assert len(samples) == 6 and all(len(s["input_ids"]) == 2 + 15 * 3 - 1 for s in samples)


def test_next_turn_index_follows_the_stored_turns(store, make_turn):
    store.upsert_session("nx")
    assert store.next_turn_index("nx") == 0
    store.add_turn(make_turn("nx", 0, [1, 2], [3]))
    store.add_turn(make_turn("nx", 1, [1, 2, 3, 4], [5]))
    assert store.next_turn_index("nx") == 2
    assert store.next_turn_index("unknown") == 0
