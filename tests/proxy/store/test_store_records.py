"""Sessions, turns, ids, fingerprints and stored responses."""

from __future__ import annotations

import dataclasses

import numpy as np
import orjson
import pytest

from proxy.store import Conflict, NotFound, Store


def test_session_upsert_and_reward(store, clock):
    s = store.sessions.upsert("s1", group_id="g", group_size=4, metadata={"a": 1})
    assert (s.session_id, s.group_id, s.group_size, s.reward, s.closed, s.metadata) == ("s1", "g", 4, None, False, {"a": 1})
    assert s.created_at == clock.t
    s = store.sessions.upsert("s1", metadata={"b": 2})
    assert s.metadata == {"a": 1, "b": 2} and s.group_id == "g"
    with pytest.raises(Conflict):
        store.sessions.upsert("s1", group_id="other")
    with pytest.raises(Conflict):
        store.sessions.upsert("s1", group_size=8)
    with pytest.raises(ValueError):
        store.sessions.upsert("s2", group_size=0)
    assert store.sessions.get("nope") is None
    r = store.sessions.set_reward("s1", 0.5)
    assert r.reward == 0.5 and r.closed and r.rewarded_at == clock.t
    with pytest.raises(Conflict, match="already has a reward"):
        store.sessions.set_reward("s1", 1.0)
    assert store.sessions.get("s1").reward == 0.5
    with pytest.raises(NotFound):
        store.sessions.set_reward("nope", 1.0)
    store.sessions.upsert("s3")
    with pytest.raises(ValueError):
        store.sessions.set_reward("s3", float("nan"))


def test_turns_round_trip_in_index_order(store, make_turn):
    store.sessions.upsert("s")
    t0 = make_turn("s", 0, [1, 2, 3], [4, 5])
    t1 = make_turn("s", 1, [1, 2, 3, 4, 5, 6], [7], version=1, parent="s-t0")
    t2 = make_turn("s", 2, [1, 2, 3, 4, 5, 6, 7, 8], [9, 10], version=[1, 2], parent="s-t1")
    for t in (t1, t0, t2):  # stored out of order; bases must still resolve
        store.turns.add(t)
    assert store.turns.list("s") == [t0, t1, t2]
    assert store.turns.get("s-t2") == t2
    assert store.turns.get("missing") is None
    assert store.turns.list("unknown") == []


def test_a_spliced_turn_goes_in_and_out_as_int32_arrays(store, make_turn):
    """The hot path's form: ``ids`` gives read-only int32 views (no per-token list), and a
    prompt committed as an int32 array is stored exactly as the list form would be."""
    store.sessions.upsert("s")
    t0 = make_turn("s", 0, [1, 2, 3], [4, 5])
    store.turns.add(t0)
    prompt, output = store.turns.ids("s-t0")
    assert prompt.dtype == output.dtype == np.int32 and prompt.tolist() == [1, 2, 3] and output.tolist() == [4, 5]
    with pytest.raises(ValueError):
        prompt[0] = 9  # the store's cached sequence is not the caller's to change
    spliced = np.concatenate((prompt, output, np.asarray([6, 7], np.int32)))
    t1 = make_turn("s", 1, spliced.tolist(), [8], parent="s-t0")
    store.turns.add(dataclasses.replace(t1, prompt_ids=spliced))
    assert store.turns.get("s-t1") == t1  # read back as lists, equal to the list-form record
    assert [x.tolist() for x in store.turns.ids("s-t1")] == [[1, 2, 3, 4, 5, 6, 7], [8]]
    with pytest.raises(ValueError, match="int32"):
        store.turns.add(dataclasses.replace(make_turn("s", 2, [1], [2 ** 31]), prompt_ids=np.asarray([1], np.int32)))
    with pytest.raises(ValueError, match="int32"):  # below the range, in a version list this time
        store.turns.add(dataclasses.replace(make_turn("s", 2, [1], [2], version=[-(2 ** 31) - 1]), prompt_ids=np.asarray([1], np.int32)))
    assert store.turns.get("s-t2") is None


def test_add_turn_rejections(store, make_turn):
    with pytest.raises(NotFound):
        store.turns.add(make_turn("nosession", 0, [1], [2]))
    store.sessions.upsert("s")
    store.turns.add(make_turn("s", 0, [1], [2]))
    with pytest.raises(Conflict, match="'s-t0' already stored"):
        store.turns.add(make_turn("s", 1, [1], [2], turn_id="s-t0"))
    with pytest.raises(Conflict, match="already has a turn with index 0"):
        store.turns.add(make_turn("s", 0, [1], [2], turn_id="other"))
    same_item = make_turn("s", 1, [1], [2], turn_id="third")
    same_item.response_id = store.turns.get("s-t0").response_id
    with pytest.raises(Conflict, match="already names another turn"):
        store.turns.add(same_item)
    bad = make_turn("s", 1, [1], [2, 3])
    bad.versions = [0]
    with pytest.raises(ValueError):
        store.turns.add(bad)
    bad = make_turn("s", 1, [1], [2])
    bad.output_logprobs = [float("-inf")]
    bad.proximal_logprobs_t = [float("-inf")]
    with pytest.raises(ValueError):
        store.turns.add(bad)
    with pytest.raises(ValueError):
        store.turns.add(make_turn("s", 1, [2**40], [2]))
    store.sessions.set_reward("s", 1.0)
    with pytest.raises(Conflict, match="closed"):
        store.turns.add(make_turn("s", 1, [1], [2]))
    assert len(store.turns.list("s")) == 1


def test_prompt_delta_survives_forks_and_cold_reads(db_path, make_turn):
    """Prompts are stored as deltas on earlier turns; every shape must rebuild exactly, cache or not."""
    store = Store(db_path)
    store.sessions.upsert("s")
    system = list(range(100, 140))
    turns = [make_turn("s", 0, system + [1], [2, 3])]
    turns.append(make_turn("s", 1, turns[0].full_ids + [4], [5], parent="s-t0"))  # spliced
    turns.append(make_turn("s", 2, system + [9, 9], [6], parent="s-t1"))  # fork sharing the system prompt
    turns.append(make_turn("s", 3, turns[1].full_ids[:-2], [7]))  # rollback: prefix of an older turn
    turns.append(make_turn("s", 4, [8] * 3, [1]))  # shares nothing
    turns.append(make_turn("s", 5, turns[4].full_ids + list(range(50)), [2], parent="s-t4"))
    for t in turns:
        store.turns.add(t)
    assert store.turns.list("s") == turns
    store.close()
    cold = Store(db_path)
    assert cold.turns.get("s-t5") == turns[5]
    assert cold.turns.get("s-t3") == turns[3]
    assert cold.turns.list("s") == turns
    cold.close()


def test_a_new_turns_proximal_values_and_pending_versions_read_back_exactly(store, make_turn):
    """A new turn's proximal values are usually its behaviour ones (stored as nothing, every
    version pending); a 0.0 against a -0.0 is a difference in the bits, kept as it was sent."""
    import math

    store.sessions.upsert("s")
    store.turns.add(make_turn("s", 0, [1], [2, 3, 4], version=[3, 3, 5]))
    t = make_turn("s", 1, [1], [5, 6], logprobs=[-0.0, -1.5], version=[5, 5])
    t.proximal_logprobs_t = [0.0, -1.5]
    store.turns.add(t)
    plain, signed = store.turns.get("s-t0"), store.turns.get("s-t1")
    assert plain.proximal_logprobs_t == plain.output_logprobs and plain.proximal_versions == [3, 3, 5]
    assert [math.copysign(1, x) for x in signed.output_logprobs] == [-1, -1]
    assert [math.copysign(1, x) for x in signed.proximal_logprobs_t] == [1, -1]
    assert store.turns.owed_ids(4) == ["s-t0"] and store.turns.owed_ids(6) == ["s-t0", "s-t1"]


def test_proximal_update(store, make_turn):
    store.sessions.upsert("s")
    t = make_turn("s", 0, [1], [2, 3, 4], version=[3, 3, 4])
    store.turns.add(t)
    store.turns.update_proximal("s-t0", [-0.5, -0.25, t.output_logprobs[2]], [4, 4, 4])
    got = store.turns.get("s-t0")
    assert got.proximal_logprobs_t == [-0.5, -0.25, t.output_logprobs[2]]
    assert got.proximal_versions == [4, 4, 4]
    assert got.output_logprobs == t.output_logprobs and got.versions == [3, 3, 4]
    with pytest.raises(ValueError):
        store.turns.update_proximal("s-t0", [-0.5], [4])
    with pytest.raises(NotFound):
        store.turns.update_proximal("nope", [], [])


def test_fingerprints_name_every_matching_turn(store, make_turn):
    """Several turns may share a history fingerprint; each candidate says whether it was continued."""
    for sid in ("a", "b"):
        store.sessions.upsert(sid)
        store.turns.add(make_turn(sid, 0, [1], [2]), fingerprints=[b"same"])
    assert [(c.turn_id, c.continued) for c in store.turns.candidates(b"same")] == [("b-t0", False), ("a-t0", False)]
    store.turns.add(make_turn("a", 1, [1, 2, 3], [4], parent="a-t0"))
    assert [(c.turn_id, c.continued) for c in store.turns.candidates(b"same")] == [("b-t0", False), ("a-t0", True)]
    assert store.turns.candidates(b"other") == []
    store.turns.add(make_turn("b", 1, [1, 2, 3], [4]))
    with pytest.raises(Conflict):  # a response id names one turn only
        store.turns.add(dataclasses.replace(make_turn("b", 2, [1], [5]), response_id=make_turn("b", 1, [], []).response_id))


def test_candidates_put_the_requested_variant_first(store, make_turn):
    """Rows stored with the request's variant (tools + kwargs) come first, then those with its
    tools (first 8 bytes), then the rest, each most recent first; ``limit`` keeps the best."""
    want, same_tools, other = b"T" * 8 + b"K" * 8, b"T" * 8 + b"k" * 8, b"t" * 8 + b"K" * 8
    order = [("a", want), ("b", other), ("c", same_tools), ("d", want), ("e", other)]
    for sid, variant in order:
        store.sessions.upsert(sid)
        store.turns.add(make_turn(sid, 0, [1], [2]), fingerprints=[(b"fp", variant)])
    got = store.turns.candidates(b"fp", want)
    assert [(c.turn_id, c.variant) for c in got] == [
        ("d-t0", want), ("a-t0", want), ("c-t0", same_tools), ("e-t0", other), ("b-t0", other)]  # fmt: skip
    assert [c.turn_id for c in store.turns.candidates(b"fp", want, limit=2)] == ["d-t0", "a-t0"]
    assert [c.turn_id for c in store.turns.candidates(b"fp")] == ["e-t0", "d-t0", "c-t0", "b-t0", "a-t0"]


def test_a_schema_5_store_keeps_its_fingerprints(tmp_path, make_turn):
    """Rows written before schema 6 have no variant; after the migration they are found as before."""
    import sqlite3

    from proxy.store import SCHEMA_VERSION

    path = str(tmp_path / "old.sqlite")
    with Store(path) as s:
        s.sessions.upsert("a")
        s.turns.add(make_turn("a", 0, [1], [2]), fingerprints=[b"x-key", b"m-key"])
    c = sqlite3.connect(path)
    c.execute("ALTER TABLE fingerprints DROP COLUMN variant")  # the file as Splice 5 wrote it
    c.execute("PRAGMA user_version=5")
    c.commit()
    c.close()
    with Store(path) as s:
        assert [(x.turn_id, x.variant) for x in s.turns.candidates(b"m-key", b"V" * 16)] == [("a-t0", None)]
        s.turns.add(make_turn("a", 1, [1, 2, 3], [4], parent="a-t0"), fingerprints=[(b"m-key", b"V" * 16)])
        assert [(x.turn_id, x.variant, x.continued) for x in s.turns.candidates(b"m-key", b"V" * 16)] == [
            ("a-t1", b"V" * 16, False), ("a-t0", None, True)]  # fmt: skip
    c = sqlite3.connect(path)
    assert c.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    c.close()


def test_responses_delta_chain(db_path):
    store = Store(db_path)
    empty_bytes = store.stats()["db_bytes"]
    convs, items = [], []
    for k in range(40):  # longer than the delta-chain bound, so full copies are interleaved
        items.append({"role": "user", "content": f"message {k} " + "x" * 200})
        conv = orjson.dumps(items)
        convs.append(conv)
        store.responses.put(f"resp_{k}", "s", f"t{k}", orjson.dumps({"id": f"resp_{k}"}), conv)
    store.responses.put("resp_other", "s2", None, b"{}", b"[]")
    with pytest.raises(Conflict):
        store.responses.put("resp_0", "s", None, b"", b"")
    for k in (0, 17, 39):
        assert store.responses.get(f"resp_{k}") == (orjson.dumps({"id": f"resp_{k}"}), convs[k])
    assert store.responses.get("resp_other") == (b"{}", b"[]")
    assert store.responses.get("nope") is None
    total = sum(len(c) for c in convs)
    store.close()
    cold = Store(db_path)
    for k in range(40):
        assert cold.responses.get(f"resp_{k}")[1] == convs[k]
    assert cold.stats()["db_bytes"] - empty_bytes < total / 10  # quadratic history stored in ~linear space
    cold.close()


def test_concurrent_threads(store, make_turn):
    """The app calls the store from the event loop and from worker threads at once."""
    import threading

    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            sid = f"w{w}"
            store.sessions.upsert(sid)
            prompt = [w, w]
            for k in range(15):
                t = make_turn(sid, k, prompt, [100 + k, 200 + k])
                store.turns.add(t, fingerprints=[f"{sid}-{k}".encode()])
                assert store.turns.get(t.turn_id) == t
                prompt = t.full_ids + [7]
            store.sessions.set_reward(sid, float(w))
            store.stats()
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    lease, samples = store.pool.pull(100, 10.0)
    assert len(samples) == 6 and all(len(s["input_ids"]) == 2 + 15 * 3 - 1 for s in samples)


def test_turn_index_assigned_in_the_commit(store, make_turn):
    """A turn given index -1 takes the session's next index inside its own transaction."""
    store.sessions.upsert("nx")
    first = store.turns.add(dataclasses.replace(make_turn("nx", 0, [1, 2], [3]), index=-1))
    second = store.turns.add(dataclasses.replace(make_turn("nx", 0, [1, 2, 3, 4], [5], turn_id="nx-b"), index=-1))
    assert (first.index, second.index) == (0, 1)
    assert [t.index for t in store.turns.list("nx")] == [0, 1]


def test_ids_kept_at_commit_equal_the_stored_ones(tmp_path, make_turn):
    """``ids`` of a turn this process committed skips the query; a reopened store (nothing
    kept) and a kept place whose ids were evicted read the same arrays from the file, and a
    turn whose commit failed leaves nothing behind."""
    path = str(tmp_path / "s.sqlite")
    store = Store(path)
    store.sessions.upsert("s")
    store.turns.add(make_turn("s", 0, [1, 2, 3], [4, 5]))
    store.turns.add(make_turn("s", 1, [1, 2, 3, 4, 5, 6, 7], [8, 9], parent="s-t0"))
    with pytest.raises(Exception):
        store.turns.add(make_turn("s", 2, [1, 2], [3], turn_id="s-t1"))  # a duplicate id: rolled back
    kept = {t: [x.tolist() for x in store.turns.ids(t)] for t in ("s-t0", "s-t1")}
    assert kept == {"s-t0": [[1, 2, 3], [4, 5]], "s-t1": [[1, 2, 3, 4, 5, 6, 7], [8, 9]]}
    store.turns._full_ids.pop(store.turns._known.get("s-t1")[0])
    assert [x.tolist() for x in store.turns.ids("s-t1")] == kept["s-t1"]
    store.close()
    reopened = Store(path)
    assert {t: [x.tolist() for x in reopened.turns.ids(t)] for t in kept} == kept
    reopened.close()
