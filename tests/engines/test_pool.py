"""EnginePool over respx fakes: abort-resume (R1), prefill (R2), routing, failover, admin."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import respx

from tests.fakes.engines import FakeSGLang, FakeVLLM, Step, default_lp, until
from engines.pool import EnginePool
from engines.types import (
    EnginePaused,
    EngineRejected,
    EngineUnavailable,
    EngineUnsupported,
    EngineVersionChanged,
    SamplingParams,
)

A = "http://engine-a:30000"
B = "http://engine-b:30000"


def run(coro):
    return asyncio.run(coro)


def make_pool(kind="sglang", urls=(A,), **kw) -> EnginePool:
    return EnginePool(kind, list(urls), health_interval_s=0, **kw)


async def held_and_paused(pool: EnginePool) -> None:
    """Wait until the request is back from the engine and held by the paused pool."""
    await until(lambda: pool.paused and pool.status()["held"] == 1)


async def update_cycle(pool: EnginePool, version: int) -> None:
    await held_and_paused(pool)
    await pool.update_weights(f"/ckpt/v{version}", version)
    await pool.resume()


# -- R1: the seed-001 timeline -------------------------------------------------------------------

SEED_PROMPT = [11, 12, 13]
P0 = len(SEED_PROMPT)
# log pi_v at absolute positions, as the worked example of docs/design.md section 4 gives them
SEED_TABLE = {(1, P0): -2.3, (2, P0): -2.2, (2, P0 + 1): -1.5, (2, P0 + 2): -2.0}


def test_seed_001_timeline_through_the_pool():
    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeSGLang(router, A, version="0")
            fake.cached = 2
            pool = make_pool()
            fake.prefill_lp = lambda v, pos, tok: SEED_TABLE.get((v, pos), -99.0)
            fake.on_abort = pool.pause
            fake.script = [
                Step([(100, -2.5)], finish="abort"),
                Step([(101, -1.8), (102, -2.1)], finish="abort"),
                Step([(103, -3.2)], finish="stop", matched=103),
            ]
            task = asyncio.create_task(pool.generate(SEED_PROMPT, SamplingParams(max_new_tokens=10), session_id="s1"))
            await update_cycle(pool, 1)
            await update_cycle(pool, 2)
            gen = await task
            await pool.close()
            return fake, gen

    fake, gen = run(go())
    assert gen.output_ids == [100, 101, 102, 103]
    assert gen.versions == [0, 1, 1, 2]
    assert gen.logprobs == [-2.5, -1.8, -2.1, -3.2]
    assert gen.proximal_logprobs_t == [-2.3, -1.5, -2.0, -3.2]
    assert gen.proximal_versions == [1, 2, 2, 2]
    assert gen.finish_reason == "stop" and gen.matched_stop == 103
    assert gen.aborts == 2 and gen.segments == 3 and gen.replica == A
    assert gen.prompt_tokens == P0 and gen.cached_tokens == 2 and gen.engine_time_s > 0
    reqs = fake.requests
    assert [r["logprob_start_len"] for r in reqs] == [-1, P0 - 1, P0 - 1]
    assert [r["input_ids"] for r in reqs] == [SEED_PROMPT, SEED_PROMPT + [100], SEED_PROMPT + [100, 101, 102]]
    assert [r["sampling_params"]["max_new_tokens"] for r in reqs] == [10, 9, 7]
    assert len({r["rid"] for r in reqs}) == 3  # a rid still in flight would be a 400
    assert {h["x-smg-routing-key"] for h in fake.headers} == {"s1"}  # sticky behind sgl-router too
    paths = [p for p, _ in fake.admin]
    assert paths == [
        "/pause_generation", "/update_weights_from_disk", "/continue_generation",
        "/pause_generation", "/update_weights_from_disk", "/continue_generation",
    ]


def test_four_segments_each_token_gets_its_own_value():
    """Three aborts, a distinct value per (version, position): the seed's ``logprob_start_len``
    from the previous iteration's length would misplace the third segment's values."""
    prompt = [21, 22, 23, 24, 25]
    p0 = len(prompt)

    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeSGLang(router, A, version="0")
            pool = make_pool()
            fake.on_abort = pool.pause
            fake.script = [
                Step([(200, -0.11), (201, -0.12)], finish="abort"),  # v0
                Step([(202, -0.21), (203, -0.22)], finish="abort"),  # v1
                Step([(204, -0.31)], finish="abort"),  # v2
                Step([(205, -0.41), (206, -0.42)], finish="stop", matched=206),  # v3
            ]
            task = asyncio.create_task(pool.generate(prompt, SamplingParams(max_new_tokens=20), session_id="s4"))
            for v in (1, 2, 3):
                await update_cycle(pool, v)
            return fake, await task

    fake, gen = run(go())
    lp = lambda v, pos: default_lp(v, pos, 0)  # noqa: E731
    assert gen.versions == [0, 0, 1, 1, 2, 3, 3]
    assert gen.proximal_logprobs_t == [
        lp(1, p0), lp(1, p0 + 1),  # v0 tokens: their value under v1, from the first resume
        lp(2, p0 + 2), lp(2, p0 + 3),  # v1 tokens: under v2, from the second resume
        lp(3, p0 + 4),  # the v2 token: under v3, from the third resume
        -0.41, -0.42,
    ]
    assert gen.proximal_versions == [1, 1, 2, 2, 3, 3, 3]
    assert len(set(gen.proximal_logprobs_t)) == 7
    resumes = fake.requests[1:]
    assert [r["logprob_start_len"] for r in resumes] == [p0 - 1] * 3
    assert [r["sampling_params"]["max_new_tokens"] for r in fake.requests] == [20, 18, 16, 15]
    assert resumes[-1]["input_ids"] == prompt + [200, 201, 202, 203, 204]
    assert gen.aborts == 3 and gen.segments == 4


def test_pause_without_weight_update_asks_for_nothing():
    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeSGLang(router, A, version="0")
            pool = make_pool()
            fake.on_abort = pool.pause
            fake.script = [Step([(1, -0.1)], finish="abort"), Step([(2, -0.2)], finish="stop")]
            task = asyncio.create_task(pool.generate([5, 6], SamplingParams(max_new_tokens=4), session_id="s"))
            await held_and_paused(pool)
            await pool.resume()
            return fake, await task

    fake, gen = run(go())
    assert [r["logprob_start_len"] for r in fake.requests] == [-1, -1]  # nothing owed: keep the cache
    assert gen.versions == [0, 0] and gen.proximal_versions == [0, 0]
    assert gen.proximal_logprobs_t == [-0.1, -0.2]


def test_token_from_before_a_plain_pause_still_gets_its_value():
    """v0 token, plain pause (no update), another v0 token, update to v1: both v0 tokens are
    owed and both get a value; a start taken from the previous iteration would skip the first."""
    prompt = [31, 32, 33]
    p0 = len(prompt)

    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeSGLang(router, A, version="0")
            pool = make_pool()
            fake.on_abort = pool.pause
            fake.script = [
                Step([(300, -0.3)], finish="abort"),
                Step([(301, -0.31)], finish="abort"),
                Step([(302, -0.32)], finish="stop"),
            ]
            task = asyncio.create_task(pool.generate(prompt, SamplingParams(max_new_tokens=6), session_id="pp"))
            await held_and_paused(pool)
            await pool.resume()
            await update_cycle(pool, 1)
            return fake, await task

    fake, gen = run(go())
    assert [r["logprob_start_len"] for r in fake.requests] == [-1, -1, p0 - 1]
    assert gen.versions == [0, 0, 1]
    assert gen.proximal_logprobs_t == [default_lp(1, p0, 0), default_lp(1, p0 + 1, 0), -0.32]
    assert gen.proximal_versions == [1, 1, 1]


def test_queued_abort_with_empty_output_just_retries():
    prompt = [1, 2, 3, 4]

    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeSGLang(router, A, version="0")
            pool = make_pool()
            fake.on_abort = pool.pause
            fake.script = [
                Step([(50, -0.5)], finish="abort"),  # v0
                Step([], finish="abort"),  # resumed at v1 but aborted again while still queued
                Step([(51, -0.6)], finish="stop"),  # v1 again
            ]
            task = asyncio.create_task(pool.generate(prompt, SamplingParams(max_new_tokens=8), session_id="q"))
            await update_cycle(pool, 1)
            await held_and_paused(pool)
            await pool.resume()  # no weight change this time
            return fake, await task

    fake, gen = run(go())
    r1, r2 = fake.requests[1], fake.requests[2]
    assert r1["input_ids"] == r2["input_ids"] == prompt + [50]
    assert r1["logprob_start_len"] == r2["logprob_start_len"] == len(prompt) - 1  # still owed
    assert r1["sampling_params"]["max_new_tokens"] == r2["sampling_params"]["max_new_tokens"] == 7
    assert gen.output_ids == [50, 51] and gen.versions == [0, 1]
    assert gen.proximal_logprobs_t == [default_lp(1, len(prompt), 50), -0.6]
    assert gen.proximal_versions == [1, 1]
    assert gen.aborts == 2 and gen.segments == 3


def test_abort_that_used_the_whole_budget_finishes_with_length():
    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeSGLang(router, A)
            pool = make_pool()
            fake.on_abort = pool.pause
            fake.script = [Step([(1, -0.1), (2, -0.2), (3, -0.3)], finish="abort")]
            gen = await pool.generate([9], SamplingParams(max_new_tokens=3), session_id="b")
            return fake, gen

    fake, gen = run(go())
    assert gen.finish_reason == "length" and gen.output_ids == [1, 2, 3]
    assert len(fake.requests) == 1 and gen.aborts == 1


def test_streaming_survives_aborts_and_delivers_each_token_once():
    async def go():
        seen: list[int] = []

        async def on_tokens(ids, logprobs):
            seen.extend(ids)

        with respx.mock(assert_all_called=False) as router:
            fake = FakeSGLang(router, A, version="0")
            pool = make_pool()
            fake.on_abort = pool.pause
            fake.script = [Step([(1, -0.1), (2, -0.2)], finish="abort"), Step([(3, -0.3), (4, -0.4)], finish="stop")]
            task = asyncio.create_task(pool.generate([7, 8], SamplingParams(max_new_tokens=9), session_id="st", on_tokens=on_tokens))
            await update_cycle(pool, 1)
            gen = await task
            return fake, gen, seen

    fake, gen, seen = run(go())
    assert seen == [1, 2, 3, 4] == gen.output_ids
    assert all(r["stream"] for r in fake.requests)
    assert gen.proximal_versions == [1, 1, 1, 1] and gen.versions == [0, 0, 1, 1]


def test_engine_reported_version_wins_and_spans_stamp_per_token():
    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeSGLang(router, A, version="7")
            pool = make_pool(version=3)
            spans = [{"start": 0, "end": 1, "version": "7"}, {"start": 1, "end": 3, "version": "8"}]
            fake.script = [Step([(1, -0.1)]), Step([(1, -0.1), (2, -0.2), (3, -0.3)], spans=spans), Step([(1, -0.1), (2, -0.2)])]
            g1 = await pool.generate([5], SamplingParams(), session_id="v")
            fake.version = "8"
            g2 = await pool.generate([5], SamplingParams(), session_id="v")
            fake.version = "default"  # not an int: the pool's version applies
            g3 = await pool.generate([5], SamplingParams(), session_id="v")
            return g1, g2, g3

    g1, g2, g3 = run(go())
    assert g1.versions == [7] and g2.versions == [7, 8, 8] and g3.versions == [3, 3]
    assert g2.proximal_versions == g2.versions


def test_held_requests_are_counted_and_released_on_close():
    async def go():
        with respx.mock(assert_all_called=False) as router:
            FakeSGLang(router, A)
            pool = make_pool()
            await pool.pause()
            task = asyncio.create_task(pool.generate([1], SamplingParams(), session_id="h"))
            await until(lambda: pool.status()["held"] == 1)
            status = pool.status()
            await pool.close()
            with pytest.raises(EngineUnavailable, match="closed"):
                await task
            return status

    status = run(go())
    assert status["paused"] is True and status["in_flight"] == 1 and status["held"] == 1
    assert status["replicas"] == [{"url": A, "healthy": True, "stale": False, "in_flight": 0}]


# -- R2: prefill-only logprobs -------------------------------------------------------------------


def test_prefill_logprobs_sglang_indexing():
    ids = [10, 11, 12, 13, 14, 15, 16, 17]

    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeSGLang(router, A, version="2")
            pool = make_pool(version=2)
            fake.script = [Step([], finish="length")]
            values = await pool.prefill_logprobs(ids, 5, session_id="r2")
            return fake, values

    fake, values = run(go())
    req = fake.requests[0]
    assert req["sampling_params"]["max_new_tokens"] == 0 and req["logprob_start_len"] == 4
    assert values == [default_lp(2, p, 0) for p in (5, 6, 7)]


def test_prefill_logprobs_vllm_indexing():
    ids = [10, 11, 12, 13, 14, 15]

    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeVLLM(router, A, version=4)
            pool = make_pool("vllm", model="tiny", version=4)
            fake.script = [Step([(1, -0.1)], finish="length")]
            return fake, await pool.prefill_logprobs(ids, 1, session_id="r2")

    fake, values = run(go())
    assert fake.requests[0]["echo"] is True and fake.requests[0]["max_tokens"] == 1
    assert values == [default_lp(4, p, 0) for p in range(1, 6)]


def test_prefill_refuses_while_paused_and_detects_a_version_change():
    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeSGLang(router, A, version="3")
            pool = make_pool(version=2)
            fake.script = [Step([], finish="length")]
            with pytest.raises(EngineVersionChanged):
                await pool.prefill_logprobs([1, 2, 3], 1, session_id="x")
            await pool.pause()
            with pytest.raises(EnginePaused):
                await pool.prefill_logprobs([1, 2, 3], 1, session_id="x")
            assert await pool.prefill_logprobs([1, 2, 3], 3, session_id="x") == []

    run(go())


# -- vLLM abort-resume ---------------------------------------------------------------------------


def test_vllm_seed_timeline_uses_echo_on_resume():
    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeVLLM(router, A, version=0)
            pool = make_pool("vllm", model="tiny")
            fake.prefill_lp = lambda v, pos, tok: SEED_TABLE.get((v, pos), -99.0)
            fake.on_abort = pool.pause
            fake.script = [
                Step([(100, -2.5)], finish="abort"),
                Step([(101, -1.8), (102, -2.1)], finish="abort"),
                Step([(103, -3.2)], finish="stop"),
            ]
            task = asyncio.create_task(pool.generate(SEED_PROMPT, SamplingParams(max_new_tokens=10), session_id="s1"))
            for v in (1, 2):  # vLLM cannot load weights over HTTP: the trainer did, Splice is told
                await held_and_paused(pool)
                pool.set_version(v)
                fake.version = v
                await pool.resume()
            return fake, await task

    fake, gen = run(go())
    assert gen.versions == [0, 1, 1, 2]
    assert gen.proximal_logprobs_t == [-2.3, -1.5, -2.0, -3.2]
    assert gen.proximal_versions == [1, 2, 2, 2]
    assert ["echo" in r for r in fake.requests] == [False, True, True]
    assert [r["max_tokens"] for r in fake.requests] == [10, 9, 7]
    assert fake.admin == ["/pause?mode=abort", "/resume", "/pause?mode=abort", "/resume"]


# -- routing and failover ------------------------------------------------------------------------


def _session_on(pool: EnginePool, url: str) -> str:
    return next(s for s in (f"sess-{i}" for i in range(1000)) if pool.replica_for(s) == url)


def test_sessions_stick_and_fail_over_when_a_replica_refuses():
    async def go():
        with respx.mock(assert_all_called=False) as router:
            fb = FakeSGLang(router, B)
            refused = router.post(f"{A}/generate").mock(side_effect=httpx.ConnectError("Connection refused"))
            pool = make_pool(urls=(A, B))
            s_a, s_b = _session_on(pool, A), _session_on(pool, B)
            assert pool.replica_for(s_a) == A and pool.replica_for(s_b) == B
            fb.script = [Step([(1, -0.1)]), Step([(2, -0.2)])]
            g1 = await pool.generate([5], SamplingParams(), session_id=s_a)  # A refuses -> B
            healthy_after = pool.status()["replicas"][0]["healthy"]
            g2 = await pool.generate([5], SamplingParams(), session_id=s_a)  # A known down -> B directly
            return g1, g2, refused.call_count, healthy_after, pool.replica_for(s_a)

    g1, g2, refused_calls, a_healthy, routed = run(go())
    assert g1.replica == B and g2.replica == B and g1.output_ids == [1]
    assert refused_calls == 1 and a_healthy is False and routed == B


def test_no_failover_once_tokens_were_accumulated():
    async def go():
        with respx.mock(assert_all_called=False) as router:
            fa = FakeSGLang(router, A, version="0")
            fb = FakeSGLang(router, B, version="0")
            pool = make_pool(urls=(A, B))
            fa.on_abort = pool.pause
            session = _session_on(pool, A)
            fa.script = [Step([(1, -0.1)], finish="abort")]
            task = asyncio.create_task(pool.generate([5], SamplingParams(max_new_tokens=4), session_id=session))
            await held_and_paused(pool)
            fa.generate_route.mock(side_effect=httpx.ConnectError("Connection refused"))
            await pool.resume()
            with pytest.raises(EngineUnavailable) as info:
                await task
            return info.value, fb.requests

    err, b_requests = run(go())
    assert err.retryable is False and err.replica == A
    assert b_requests == []


def test_rejected_request_is_not_retried_elsewhere():
    async def go():
        with respx.mock(assert_all_called=False) as router:
            fa = FakeSGLang(router, A)
            fb = FakeSGLang(router, B)
            pool = make_pool(urls=(A, B))
            fa.script = [Step(status=400)]
            with pytest.raises(EngineRejected):
                await pool.generate([5], SamplingParams(), session_id=_session_on(pool, A))
            return fb.requests

    assert run(go()) == []


def test_server_error_before_any_token_fails_over_once():
    async def go():
        with respx.mock(assert_all_called=False) as router:
            fa = FakeSGLang(router, A)
            fb = FakeSGLang(router, B)
            pool = make_pool(urls=(A, B))
            fa.script = [Step(status=500)]
            fb.script = [Step(raw=b"<html>bad gateway")]
            from engines.types import EngineBadResponse

            with pytest.raises(EngineBadResponse):
                await pool.generate([5], SamplingParams(), session_id=_session_on(pool, A))
            return len(fa.requests), len(fb.requests)

    assert run(go()) == (1, 1)  # one retry, not more


# -- admin ---------------------------------------------------------------------------------------


def test_update_weights_failure_keeps_the_version():
    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeSGLang(router, A)
            pool = make_pool(version=4)
            fake.update_ok = False
            with pytest.raises(EngineRejected, match="no such file"):
                await pool.update_weights("/nope", 5)
            return pool.version

    assert run(go()) == 4


def test_update_weights_marks_a_down_replica_stale_and_routes_around_it():
    async def go():
        with respx.mock(assert_all_called=False) as router:
            fa = FakeSGLang(router, A)
            router.post(f"{B}/update_weights_from_disk").mock(side_effect=httpx.ConnectError("refused"))
            pool = make_pool(urls=(A, B))
            session = _session_on(pool, B)
            await pool.update_weights("/ckpt/v1", 1)
            fa.script = [Step([(1, -0.1)])]
            gen = await pool.generate([5], SamplingParams(), session_id=session)
            return pool.version, pool.status()["replicas"], gen.replica

    version, replicas, replica = run(go())
    assert version == 1 and replica == A
    assert replicas[1]["url"] == B and replicas[1]["stale"] is True


def test_vllm_without_dev_mode_update_weights_is_unsupported_but_set_version_works():
    async def go():
        with respx.mock(assert_all_called=False) as router:
            FakeVLLM(router, A, dev_mode=False)
            pool = make_pool("vllm")
            await pool.start()  # learns the served model name from /v1/models
            with pytest.raises(EngineUnsupported):
                await pool.update_weights("/ckpt", 1)
            v_after_failure = pool.version
            pool.set_version(1)
            model = pool.model
            await pool.close()
            return v_after_failure, pool.version, model

    assert run(go()) == (0, 1, "tiny")


def test_health_reports_each_replica():
    async def go():
        with respx.mock(assert_all_called=False) as router:
            FakeSGLang(router, A)
            router.get(f"{B}/health").mock(side_effect=httpx.ConnectError("refused"))
            pool = EnginePool("sglang", [A, B], health_interval_s=0.01)
            await pool.start()
            await asyncio.sleep(0.05)  # the background loop runs too
            result = await pool.health()
            await pool.close()
            return result

    assert run(go()) == {A: True, B: False}


def test_single_replica_retries_once_when_nothing_came_back():
    """A kept-alive connection the engine closed under load: retried on the same replica."""

    async def go():
        with respx.mock(assert_all_called=False) as router:
            fa = FakeSGLang(router, A)
            fa.script = [Step([(7, -0.7)])]
            real = fa.generate_route.side_effect
            calls = {"n": 0}

            def flaky(request):
                calls["n"] += 1
                if calls["n"] == 1:
                    raise httpx.ReadError("connection closed")
                return real(request)

            fa.generate_route.mock(side_effect=flaky)
            pool = make_pool(urls=(A,))
            return await pool.generate([5], SamplingParams(), session_id="s"), calls["n"]

    gen, n = run(go())
    assert gen.output_ids == [7] and n == 2


# -- R2 on the next turn: prompt input logprobs from a start position ----------------------------


def test_generate_asks_for_prompt_logprobs_from_the_first_owed_position():
    """SGLang: to get token k pass logprob_start_len <= k-1 (its first entry is null)."""
    prompt = [5, 6, 7, 8, 9, 10]

    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeSGLang(router, A, version="3")
            fake.script = [Step([(20, -0.4)], finish="stop", matched=20), Step([(21, -0.3)], finish="stop", matched=21)]
            pool = make_pool()
            gen = await pool.generate(prompt, SamplingParams(max_new_tokens=4), session_id="s", prompt_logprobs_from=2)
            plain = await pool.generate(prompt, SamplingParams(max_new_tokens=4), session_id="s")
            await pool.close()
            return fake, gen, plain

    fake, gen, plain = run(go())
    assert fake.requests[0]["logprob_start_len"] == 1
    assert fake.requests[1]["logprob_start_len"] == -1  # not asked: prefix cache untouched
    assert gen.prompt_logprobs_start == 2 and gen.prompt_logprobs_version == 3
    assert gen.prompt_logprobs == [default_lp(3, p, prompt[p]) for p in range(2, len(prompt))]
    assert gen.output_ids == [20] and gen.logprobs == [-0.4]  # the turn itself is unchanged
    assert plain.prompt_logprobs == [] and plain.prompt_logprobs_version is None


@pytest.mark.parametrize("stream", [False, True])
def test_vllm_generate_takes_prompt_logprobs_from_echo(stream):
    prompt = [5, 6, 7, 8, 9]

    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeVLLM(router, A, version=2)
            fake.weight_version = "2"
            fake.script = [Step([(30, -0.2), (31, -0.1)], finish="stop", matched=31)]
            pool = make_pool("vllm", model="tiny")
            seen: list[int] = []

            async def on_tokens(ids, lps):
                seen.extend(ids)

            gen = await pool.generate(
                prompt, SamplingParams(max_new_tokens=4), session_id="s", prompt_logprobs_from=3,
                on_tokens=on_tokens if stream else None,
            )  # fmt: skip
            await pool.close()
            return fake, gen, seen

    fake, gen, seen = run(go())
    assert fake.requests[0]["echo"] is True
    assert gen.prompt_logprobs == [default_lp(2, p, prompt[p]) for p in (3, 4)]
    assert gen.prompt_logprobs_version == 2 and gen.output_ids == [30, 31]
    if stream:
        assert seen == [30, 31]  # the echoed prompt is never delivered as output


def test_prompt_logprobs_come_from_the_first_segment_only_with_its_version():
    """An update during the turn: the first segment's prefill ran under v0, so its values are
    v0's (for tokens of v-1 = none here); the resume asks only for the accumulated output (R1)."""
    prompt = [11, 12, 13, 14]

    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeSGLang(router, A, version="0")
            pool = make_pool()
            fake.on_abort = pool.pause
            fake.script = [Step([(100, -2.5)], finish="abort"), Step([(101, -1.8)], finish="stop", matched=101)]
            task = asyncio.create_task(
                pool.generate(prompt, SamplingParams(max_new_tokens=10), session_id="s", prompt_logprobs_from=1)
            )
            await update_cycle(pool, 1)
            gen = await task
            await pool.close()
            return fake, gen

    fake, gen = run(go())
    assert [r["logprob_start_len"] for r in fake.requests] == [0, len(prompt) - 1]
    assert gen.prompt_logprobs_version == 0
    assert gen.prompt_logprobs == [default_lp(0, p, prompt[p]) for p in range(1, len(prompt))]
    assert gen.proximal_versions == [1, 1] and gen.proximal_logprobs_t[0] == default_lp(1, len(prompt), 100)
