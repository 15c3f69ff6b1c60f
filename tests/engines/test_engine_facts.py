"""Engine facts read at start-up, the context rule, all-or-nothing pause, vLLM weight updates
through the pool, and credentials never shown: all over respx fakes shaped like SGLang / vLLM."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
import respx

from tests.fakes.engines import FakeSGLang, FakeVLLM, Step, until
from engines.http_transport import EngineTransport
from engines.http import redact_url
from engines.pool import EnginePool, merge_info
from engines.sglang import SGLangClient
from engines.types import (
    ContextLengthExceeded,
    EngineBadResponse,
    EngineInfo,
    EngineRejected,
    EngineUnsupported,
    SamplingParams,
)

A = "http://engine-a:30000"
B = "http://engine-b:30000"


def run(coro):
    return asyncio.run(coro)


def make_pool(kind="sglang", urls=(A,), **kw) -> EnginePool:
    return EnginePool(kind, list(urls), health_interval_s=0, **kw)


def _session_on(pool: EnginePool, url: str) -> str:
    return next(f"s{i}" for i in range(10_000) if pool.replica_for(f"s{i}") == url)


# -- facts ---------------------------------------------------------------------------------------


def test_sglang_info_from_v1_models_and_model_info():
    async def go():
        with respx.mock(assert_all_called=False) as router:
            FakeSGLang(router, A, version="5", context_length=40960, model_path="/ckpt/qwen3", served_model="qwen3-8b")
            async with httpx.AsyncClient(transport=EngineTransport()) as http:
                return await SGLangClient(http, A).info()

    info = run(go())
    assert info == EngineInfo(
        context_length=40960,
        model_path="/ckpt/qwen3",
        served_model="qwen3-8b",
        weight_version=5,
        can_pause=True,
        can_reload=True,
        tied_lm_head=None,
        warnings=(),
    )


def test_sglang_info_falls_back_to_server_info_and_old_paths():
    """A release whose /v1/models lacks max_model_len and that only has /get_model_info."""

    async def go():
        with respx.mock(assert_all_called=False) as router:
            router.get(f"{A}/v1/models").mock(return_value=httpx.Response(200, json={"object": "list", "data": [{"id": "m"}]}))
            router.get(f"{A}/model_info").mock(return_value=httpx.Response(404, json={"detail": "Not Found"}))
            router.get(f"{A}/get_model_info").mock(
                return_value=httpx.Response(200, json={"model_path": "/m", "weight_version": "default", "is_generation": True})
            )
            router.get(f"{A}/server_info").mock(return_value=httpx.Response(404, json={"detail": "Not Found"}))
            router.get(f"{A}/get_server_info").mock(return_value=httpx.Response(200, json={"context_length": 8192}))
            for path in ("/pause_generation", "/continue_generation", "/update_weights_from_disk"):
                router.get(f"{A}{path}").mock(return_value=httpx.Response(404, json={"detail": "Not Found"}))
            async with httpx.AsyncClient(transport=EngineTransport()) as http:
                return await SGLangClient(http, A).info()

    info = run(go())
    assert info.context_length == 8192 and info.model_path == "/m" and info.served_model == "m"
    assert info.weight_version is None  # "default" is no integer version
    assert not info.can_pause and not info.can_reload and len(info.warnings) == 2


def test_pool_start_merges_replica_facts_and_sets_the_vllm_model():
    async def go():
        with respx.mock(assert_all_called=False) as router:
            FakeVLLM(router, A, max_model_len=4096, served="tiny", root="/models/tiny")
            FakeVLLM(router, B, max_model_len=2048, served="tiny", root="/models/tiny")
            pool = make_pool("vllm", urls=(A, B))
            await pool.start()
            await pool.close()
            return pool

    pool = run(go())
    assert pool.info.context_length == 2048  # the smallest: every replica must fit the turn
    assert pool.info.served_model == "tiny" and pool.model == "tiny" and pool.info.model_path == "/models/tiny"
    assert pool.info.can_pause and pool.info.can_reload and pool.info.weight_version is None
    assert pool.status()["context_length"] == 2048
    assert any("different context lengths" in w for w in pool.info.warnings)


def test_pool_start_without_vllm_dev_mode_warns_or_fails_when_required(caplog):
    async def go(require: bool):
        with respx.mock(assert_all_called=False) as router:
            FakeVLLM(router, A, dev_mode=False)
            pool = make_pool("vllm")
            try:
                await pool.start(require_control=require)
            finally:
                await pool.close()
            return pool

    with caplog.at_level(logging.WARNING, logger="engines.pool"):
        pool = run(go(False))
    assert not pool.info.can_pause and "VLLM_SERVER_DEV_MODE=1" in caplog.text
    with pytest.raises(EngineUnsupported, match="VLLM_SERVER_DEV_MODE=1"):
        run(go(True))


def test_merge_info_with_a_replica_down():
    a = EngineInfo(context_length=100, model_path="/a", served_model="m", weight_version=2, can_pause=True, can_reload=True)
    merged = merge_info([None, a], [A, B])
    assert merged.context_length == 100 and merged.model_path == "/a" and merged.weight_version == 2
    assert merged.can_pause and merged.can_reload
    assert merge_info([None], [A]).context_length is None
    split = merge_info([a, EngineInfo(context_length=100, weight_version=3)], [A, B])
    assert split.weight_version is None and not split.can_pause


# -- context rule --------------------------------------------------------------------------------


def test_max_new_tokens_leaves_room_for_the_recompute_prefill():
    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeSGLang(router, A, context_length=10)
            pool = make_pool()
            await pool.start()
            got = (pool.max_new_tokens(4), pool.max_new_tokens(4, 3), pool.max_new_tokens(8, 100))
            with pytest.raises(ContextLengthExceeded) as err:
                pool.max_new_tokens(9)
            # generate() applies the same cap whatever the caller asked for
            fake.script = [Step([(1, -0.1)], finish="length")]
            await pool.generate([5, 6, 7, 8], SamplingParams(max_new_tokens=500), session_id="s")
            with pytest.raises(ContextLengthExceeded):
                await pool.generate(list(range(9)), SamplingParams(), session_id="s")
            await pool.close()
            return got, err.value, fake.requests

    got, err, requests = run(go())
    assert got == (5, 3, 1)  # 4 + 5 + 1 == 10: prompt + output + one prefill token fit
    assert err.code == "context_length_exceeded" and err.status_code == 400
    assert len(requests) == 1 and requests[0]["sampling_params"]["max_new_tokens"] == 5


def test_unknown_context_length_passes_requests_through():
    pool = make_pool()
    assert pool.max_new_tokens(10**6, 7) == 7
    with pytest.raises(ValueError):
        pool.max_new_tokens(10)


# -- pause: all or nothing -----------------------------------------------------------------------


def test_failed_pause_resumes_the_paused_replicas_and_leaves_the_pool_unpaused():
    async def go():
        with respx.mock(assert_all_called=False) as router:
            fa = FakeSGLang(router, A)
            fb = FakeSGLang(router, B)
            fb.pause_status = 500
            pool = make_pool(urls=(A, B))
            with pytest.raises(EngineBadResponse) as err:
                await pool.pause()
            paused_after = pool.paused
            # new turns are not held: the pool is usable at once
            fa.script = [Step([(1, -0.1)])]
            gen = await asyncio.wait_for(pool.generate([5], SamplingParams(), session_id=_session_on(pool, A)), 2)
            return err.value, paused_after, fa.admin, gen

    err, paused_after, admin_a, gen = run(go())
    assert paused_after is False and gen.output_ids == [1]
    assert [p for p, _ in admin_a] == ["/pause_generation", "/continue_generation"]
    assert err.replica == B and B in str(err) and "resumed 1 replica" in str(err) and "scheduler busy" in str(err)


def test_failed_pause_releases_requests_it_was_holding():
    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeVLLM(router, A)
            fake.pause_status = 500
            pool = make_pool("vllm")
            pool.model = "tiny"
            fake.script = [Step([(3, -0.3)], finish="abort"), Step([(4, -0.4)], finish="stop")]
            pause_err: list[BaseException] = []

            async def pause_on_abort():
                try:
                    await pool.pause()
                except EngineBadResponse as exc:
                    pause_err.append(exc)

            fake.on_abort = pause_on_abort
            gen = await asyncio.wait_for(pool.generate([9, 9], SamplingParams(max_new_tokens=4), session_id="s"), 5)
            return gen, pause_err, pool.paused

    gen, errs, paused = run(go())
    assert gen.output_ids == [3, 4] and len(errs) == 1 and paused is False
    assert "/pause" in str(errs[0]) and "Failed to pause generation" in str(errs[0])


def test_pause_error_redacts_credentials_in_engine_urls():
    secret = "http://trainer:s3cret@engine-c:30000"

    async def go():
        with respx.mock(assert_all_called=False) as router:
            router.post("http://engine-c:30000/pause_generation").mock(
                return_value=httpx.Response(503, json={"error": {"message": "not ready"}})
            )
            router.post("http://engine-c:30000/continue_generation").mock(return_value=httpx.Response(200, json={}))
            pool = make_pool(urls=(secret,))
            with pytest.raises(EngineBadResponse) as err:
                await pool.pause()
            return err.value, pool, router.calls.last.request

    err, pool, request = run(go())
    assert "s3cret" not in str(err) and "trainer:***@engine-c" in str(err) and "s3cret" not in err.replica
    assert pool.urls == ["http://trainer:***@engine-c:30000"] and "s3cret" not in str(pool.status())
    assert request.headers["authorization"].startswith("Basic ")  # the credentials are still sent


def test_redact_url():
    assert redact_url("http://u:p@h:1/x?q=1") == "http://u:***@h:1/x?q=1"
    assert redact_url("http://u@h") == "http://u@h"
    assert redact_url("http://h:8000") == "http://h:8000"


# -- weight updates through the pool -------------------------------------------------------------


def test_vllm_pool_update_cycle_with_abort_resume():
    """pause -> reload_weights -> update_weight_version -> resume, with R1 across it."""

    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeVLLM(router, A)
            pool = make_pool("vllm")
            await pool.start()
            fake.script = [Step([(3, -0.3)], finish="abort"), Step([(4, -0.4)], finish="stop")]
            fake.on_abort = pool.pause  # the engine aborts because Splice paused it
            task = asyncio.create_task(pool.generate([9, 9], SamplingParams(max_new_tokens=4), session_id="s"))
            await until(lambda: pool.paused and pool.status()["held"] == 1)
            await pool.update_weights("/ckpt/v1", 1)
            await pool.resume()
            gen = await asyncio.wait_for(task, 5)
            await pool.close()
            return fake, gen, pool.version

    fake, gen, version = run(go())
    assert version == 1 and fake.weight_version == "1"
    assert fake.rpc == [{"method": "reload_weights", "kwargs": {"weights_path": "/ckpt/v1"}}]
    assert gen.versions == [0, 1] and gen.proximal_versions == [1, 1]
    assert fake.requests[1]["echo"] is True  # the v0 token is owed its v1 value


def test_vllm_pool_reload_failure_keeps_the_version():
    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeVLLM(router, A)
            fake.reload_error = "bad path"
            pool = make_pool("vllm", version=4)
            with pytest.raises(EngineBadResponse, match="update_weights"):
                await pool.update_weights("/nope", 5)
            return pool.version

    assert run(go()) == 4


def test_vllm_tied_head_update_warns(caplog):
    async def go():
        with respx.mock(assert_all_called=False) as router:
            FakeVLLM(router, A, tied=True)
            pool = make_pool("vllm")
            await pool.start()
            await pool.update_weights("/ckpt/v1", 1)
            await pool.close()
            return pool

    with caplog.at_level(logging.WARNING, logger="engines.pool"):
        pool = run(go())
    assert pool.info.tied_lm_head is True and pool.version == 1
    assert sum("tie_word_embeddings" in r.getMessage() for r in caplog.records) >= 2  # at start and at the update


def test_vllm_tied_head_loads_through_the_worker_extension(caplog):
    """vLLM started with Splice's worker extension: weight loads go through it (which re-ties the
    head) and nobody is warned; the version still moves only after the load."""

    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeVLLM(router, A, tied=True, extension=True)
            pool = make_pool("vllm")
            await pool.start()
            await pool.update_weights("/ckpt/v1", 1)
            await pool.update_weights("/ckpt/v2", 2)
            await pool.close()
            return pool, fake

    with caplog.at_level(logging.WARNING):
        pool, fake = run(go())
    assert pool.info.tied_lm_head is True and pool.info.worker_extension is True and pool.version == 2
    assert [r["method"] for r in fake.rpc] == ["splice_reload_weights", "splice_reload_weights"]
    assert [r["kwargs"] for r in fake.rpc] == [{"weights_path": "/ckpt/v1"}, {"weights_path": "/ckpt/v2"}]
    assert not any("tie_word_embeddings" in r.getMessage() for r in caplog.records)
    assert pool.info.warnings == ()


def test_vllm_without_the_extension_keeps_vllms_own_reload():
    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeVLLM(router, A, tied=False)
            pool = make_pool("vllm")
            await pool.start()
            await pool.update_weights("/ckpt/v1", 1)
            await pool.close()
            return pool, fake

    pool, fake = run(go())
    assert pool.info.worker_extension is False and [r["method"] for r in fake.rpc] == ["reload_weights"]


def test_sglang_model_path_is_sent_untouched():
    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeSGLang(router, A)
            pool = make_pool()
            await pool.update_weights("~/not/expanded/../ckpt", 2)
            return fake.admin

    admin = run(go())
    assert admin == [
        ("/update_weights_from_disk", {"model_path": "~/not/expanded/../ckpt", "weight_version": "2", "flush_cache": True})
    ]


def test_rejected_update_is_the_engines_answer():
    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeSGLang(router, A)
            fake.update_ok = False
            with pytest.raises(EngineRejected, match="no such file"):
                await make_pool().update_weights("/x", 1)

    run(go())
