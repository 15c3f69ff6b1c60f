"""Fleet behaviour of the engine pool (docs/fleet.md): load-aware sticky routing, the routing
header, engine-reported versions winning over the pool's belief, following the engines' version,
and loading on named engines only, once."""

from __future__ import annotations

import asyncio

import pytest
import respx

from engines.pool import EnginePool, engine_id
from engines.routing import StickyTable
from engines.types import SamplingParams
from tests.fakes.engines import FakeSGLang, FakeVLLM, Step

A = "http://engine-a:30000"
B = "http://engine-b:30000"


def run(coro):
    return asyncio.run(coro)


# -- StickyTable ---------------------------------------------------------------------------------


def test_first_placement_is_least_loaded_then_sticky():
    t = StickyTable()
    ring = ["a", "b", "c"]
    load = {"a": 3, "b": 1, "c": 1}
    assert t.place("s1", ring, load, lambda n: True)[0] == "b"  # least loaded; ring order breaks the tie
    load["b"] = 9
    assert t.place("s1", ring, load, lambda n: True) == ["b", "a", "c"]  # sticky however busy it got
    assert t.place("s2", ring, load, lambda n: True)[0] == "c"


def test_unusable_sticky_replica_is_replaced_and_the_new_one_remembered():
    t = StickyTable()
    ring = ["a", "b"]
    t.place("s", ring, {"a": 0, "b": 5}, lambda n: True)
    assert t.get("s") == "a"
    assert t.place("s", ring, {"a": 0, "b": 5}, lambda n: n != "a")[0] == "b"
    assert t.place("s", ring, {"a": 0, "b": 5}, lambda n: True)[0] == "b"  # stays on b once moved


def test_capacity_forgets_least_recently_used():
    t = StickyTable(capacity=2)
    for s in ("s1", "s2"):
        t.place(s, ["a"], {}, lambda n: True)
    t.get("s1")
    t.place("s3", ["a"], {}, lambda n: True)
    assert len(t) == 2 and t.get("s2") is None and t.get("s1") == "a"


def test_engine_id_is_stable_across_spellings():
    assert engine_id("HTTP://Engine-A:30000/") == engine_id("http://engine-a:30000") == "http://engine-a:30000"
    assert engine_id("http://u:***@Host:1/v1/") == "http://u:***@host:1/v1"


# -- the pool ------------------------------------------------------------------------------------


def test_least_loaded_pool_places_new_sessions_on_the_idle_replica():
    pool = EnginePool("sglang", [A, B], health_interval_s=0, routing="least-loaded")
    pool._replicas[A].in_flight = 4
    assert pool.replica_for("s-new") == B
    pool._replicas[A].in_flight = 0
    pool._replicas[B].in_flight = 7
    assert pool.replica_for("s-new") == B  # sticky
    assert pool.replica_for("s-other") == A
    assert pool.status()["routing"] == "least-loaded"
    with pytest.raises(ValueError):
        EnginePool("sglang", [A], routing="random")


def test_least_loaded_generation_stays_on_its_replica_and_sends_the_routing_key():
    async def go():
        with respx.mock(assert_all_called=False) as router:
            fa, fb = FakeSGLang(router, A), FakeSGLang(router, B)
            pool = EnginePool("sglang", [A, B], health_interval_s=0, routing="least-loaded")
            await pool.start()
            for f in (fa, fb):
                f.script = [Step([(7, -1.0)], finish="stop") for _ in range(3)]
            used = []
            for _ in range(3):
                gen = await pool.generate([1, 2, 3], SamplingParams(max_new_tokens=4), session_id="sess-1")
                used.append(gen.replica)
            await pool.close()
            return fa, fb, used

    fa, fb, used = run(go())
    assert len(set(used)) == 1
    sent = fa.headers + fb.headers
    assert len(sent) == 3 and all(h["x-smg-routing-key"] == "sess-1" for h in sent)


def test_vllm_requests_carry_the_routing_key_and_tokens_take_the_engines_version():
    """The pool believes v0 (stale: another proxy published v4); the engine says v4."""

    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeVLLM(router, A, version=0)
            pool = EnginePool("vllm", [A], model="tiny", health_interval_s=0)
            fake.script = [Step([(5, -1.0), (6, -2.0)], finish="stop")]
            fake.weight_version, fake.version = "4", 4  # loaded through another proxy after start()
            gen = await pool.generate([1, 2], SamplingParams(max_new_tokens=4), session_id="s-v")
            calls = [c.request for c in router.calls if c.request.url.path == "/v1/completions"]
            return gen, calls, pool

    gen, calls, pool = run(go())
    assert gen.versions == [4, 4] and gen.proximal_versions == [4, 4]
    assert calls[0].headers["x-smg-routing-key"] == "s-v"
    assert pool.status()["engine_replicas"][0]["weight_version"] == 4


def test_sglang_reported_version_wins_over_a_stale_pool():
    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeSGLang(router, A, version="0")
            pool = EnginePool("sglang", [A], health_interval_s=0)
            await pool.start()
            fake.version = "2"  # published through another proxy; this one was not told yet
            fake.script = [Step([(5, -1.0)], finish="stop")]
            gen = await pool.generate([1, 2], SamplingParams(max_new_tokens=4), session_id="s")
            return gen, pool

    gen, pool = run(go())
    assert gen.versions == [2] and pool.version == 0


def test_a_restarted_pool_adopts_the_engines_version_and_follows_it_forward():
    async def go():
        with respx.mock(assert_all_called=False) as router:
            fa, fb = FakeSGLang(router, A, version="3"), FakeSGLang(router, B, version="3")
            pool = EnginePool("sglang", [A, B], health_interval_s=0)
            await pool.start()
            at_start = pool.version
            fa.version = fb.version = "4"
            followed = await pool._poll_versions()
            after = pool.version
            fa.version = "5"  # replicas disagree (mid-update): no change
            await pool._poll_versions()
            disagree = pool.version
            fa.version = fb.version = "2"  # never backwards outside start-up
            await pool._poll_versions()
            return at_start, followed, after, disagree, pool.version

    at_start, followed, after, disagree, final = run(go())
    assert at_start == 3 and followed and after == 4 and disagree == 4 and final == 4


def test_update_weights_on_named_engines_only_and_idempotent():
    async def go():
        with respx.mock(assert_all_called=False) as router:
            fa, fb = FakeSGLang(router, A, version="0"), FakeSGLang(router, B, version="0")
            pool = EnginePool("sglang", [A, B], health_interval_s=0)
            await pool.start()
            first = await pool.update_weights("/ckpt/v1", 1, engines=["HTTP://ENGINE-B:30000/"])
            v_after = pool.version
            again = await pool.update_weights("/ckpt/v1", 1, engines=[B])
            with pytest.raises(ValueError, match="unknown engine"):
                await pool.update_weights("/ckpt/v1", 1, engines=["http://elsewhere:1"])
            none = await pool.update_weights("/ckpt/v1", 1, engines=[])
            return fa, fb, first, again, none, v_after

    fa, fb, first, again, none, v_after = run(go())
    loads = lambda f: [p for p, _ in f.admin if p == "/update_weights_from_disk"]  # noqa: E731
    assert loads(fa) == [] and len(loads(fb)) == 1
    assert first == {"loaded": [B], "skipped": [], "stale": []} and v_after == 1
    assert again == {"loaded": [], "skipped": [B], "stale": []}
    assert none == {"loaded": [], "skipped": [], "stale": []}
