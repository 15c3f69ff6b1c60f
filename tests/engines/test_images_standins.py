"""Images through the strict SGLang / vLLM stand-ins and the engine pool: the released
servers' rules (tests/fakes/engines.py), abort-resume (R1) and prefill (R2) with images."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import respx

from engines.http_transport import EngineTransport
from engines.pool import EnginePool
from engines.types import EngineBadResponse, EngineRejected, SamplingParams
from tests.engines.image_cases import BANNED, BLUE, GREEN, HEAD, RED, TAIL, collapsed, prompt, url
from tests.fakes.engines import FakeSGLang, FakeVLLM, Step, default_lp, until

A = "http://engine-a:30000"
PAD = 151655


def run(coro):
    return asyncio.run(coro)


async def post(url: str, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(transport=EngineTransport()) as http:
        return await http.post(url, json=body)


def sglang_body(ids, images_urls, **extra):
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4}, "return_logprob": True,
            "logprob_start_len": -1, "rid": "x", "stream": False}
    if images_urls is not None:
        body["image_data"] = images_urls
    body.update(extra)
    return body


# -- the SGLang stand-in ---------------------------------------------------------------------------


def test_sglang_standin_crashes_on_pre_expanded_pads_like_the_server():
    ids, images = prompt(HEAD, RED, TAIL)

    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeSGLang(router, A)
            fake.script = [Step([(5, -1.0)])]
            expanded = await post(f"{A}/generate", sglang_body(ids, [url(RED)]))
            missing = await post(f"{A}/generate", sglang_body(collapsed(ids), [url(RED), url(BLUE)]))
            broken = await post(f"{A}/generate", sglang_body(collapsed(ids), ["data:image/png;base64,bm90IGFuIGltYWdl"]))
            ok = await post(f"{A}/generate", sglang_body(collapsed(ids), [url(RED)]))
            return expanded, missing, broken, ok

    expanded, missing, broken, ok = run(go())
    assert expanded.status_code == 500 and expanded.text == "Internal Server Error"
    assert missing.status_code == 400 and "prompt has 1 image placeholder token(s) but 2 image(s)" in missing.text
    assert broken.status_code == 400 and "loading IMAGE data at index 0" in broken.text
    meta = ok.json()["meta_info"]
    assert ok.status_code == 200 and meta["prompt_tokens"] == len(ids) == len(collapsed(ids)) + 19


def test_sglang_standin_checks_sampling_keys_and_logit_bias_range():
    ids = HEAD + TAIL

    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeSGLang(router, A)
            fake.script = [Step([(5, -1.0)])]
            unknown = await post(f"{A}/generate", sglang_body(ids, None, sampling_params={"max_new_tokens": 2, "logprobs": 1}))
            out_of_vocab = await post(f"{A}/generate", sglang_body(ids, None, sampling_params={"logit_bias": {"151936": -100.0}}))
            fine = await post(f"{A}/generate", sglang_body(ids, None, sampling_params={"logit_bias": {"151655": -100.0}}))
            return unknown, out_of_vocab, fine

    unknown, out_of_vocab, fine = run(go())
    assert unknown.status_code == 400 and "unknown field `logprobs`" in unknown.text
    assert out_of_vocab.status_code == 400 and "logit_bias must has keys in [0, 151935]" in out_of_vocab.text
    assert fine.status_code == 200


# -- the vLLM stand-in ------------------------------------------------------------------------------


def vllm_body(ids, urls, **extra):
    body = {"token_ids": ids, "sampling_params": {"max_tokens": 4, "logprobs": 0}, "return_token_ids": True}
    if urls is not None:
        body["content_parts"] = [{"type": "image_url", "url": u} for u in urls]
    body.update(extra)
    return body


def test_vllm_standin_validates_like_the_pydantic_model():
    ids, images = prompt(HEAD, BLUE, TAIL)

    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeVLLM(router, A)
            fake.script = [Step([(5, -1.0)]), Step([(6, -1.0)]), Step([(7, -1.0)])]
            both = await post(f"{A}/inference/v1/generate", vllm_body(collapsed(ids), [url(BLUE)], features={"mm_hashes": {}, "mm_placeholders": {}}))
            empty = await post(f"{A}/inference/v1/generate", vllm_body([], None))
            no_params = await post(f"{A}/inference/v1/generate", {"token_ids": [1, 2]})
            unknown_keys = await post(f"{A}/inference/v1/generate", vllm_body(collapsed(ids), [url(BLUE)], shiny=1))
            expanded = await post(f"{A}/inference/v1/generate", vllm_body(ids, [url(BLUE)]))
            missing = await post(f"{A}/inference/v1/generate", vllm_body(collapsed(ids), [url(BLUE), url(RED)]))
            return both, empty, no_params, unknown_keys, expanded, missing

    both, empty, no_params, unknown_keys, expanded, missing = run(go())
    assert both.status_code == 400 and "mutually exclusive" in both.json()["error"]["message"]
    assert empty.status_code == 400 and "at least 1 item" in empty.text and empty.json()["error"]["param"] == "body.token_ids"
    assert no_params.status_code == 400 and no_params.json()["error"]["param"] == "body.sampling_params"
    assert missing.status_code == 500 and "found 1 prompt updates" in missing.text
    # unknown top-level keys are ignored, as pydantic's default model config does
    assert unknown_keys.status_code == 200
    assert unknown_keys.json()["mm_placeholders"] == {"image": [{"offset": images[0].offset, "length": 4}]}
    # pre-expanded ids: only the first pad is replaced; the extra pads silently stay as text
    assert expanded.status_code == 200 and expanded.json()["usage"]["prompt_tokens"] == len(ids) + 3


def test_vllm_standin_without_scale_out_answers_403():
    ids, _ = prompt(HEAD, BLUE, TAIL)

    async def go():
        with respx.mock(assert_all_called=False) as router:
            FakeVLLM(router, A, scale_out=False)
            return await post(f"{A}/inference/v1/generate", vllm_body(collapsed(ids), [url(BLUE)]))

    reply = run(go())
    assert reply.status_code == 403 and "--enable-scale-out" in reply.json()["error"]["message"]


# -- the pool: R1 and R2 with images ---------------------------------------------------------------


def make_pool(kind="sglang", **kw) -> EnginePool:
    return EnginePool(kind, [A], health_interval_s=0, **kw)


async def update_cycle(pool: EnginePool, version: int) -> None:
    await until(lambda: pool.paused and pool.status()["held"] == 1)
    await pool.update_weights(f"/ckpt/v{version}", version)
    await pool.resume()


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_abort_resume_resends_every_image_at_unchanged_offsets(kind):
    """Three segments across two updates: each resume carries both images again, its
    continuation is collapsed prompt + output, and every proximal value is the engine's value
    at that token's expanded position."""
    ids, images = prompt(HEAD, RED, [1234, 5678], GREEN, TAIL)
    p0 = len(ids)

    async def go():
        with respx.mock(assert_all_called=False) as router:
            if kind == "sglang":
                fake = FakeSGLang(router, A, version="0")
                pool = make_pool()
            else:
                fake = FakeVLLM(router, A, version=0)
                pool = make_pool("vllm", model="tiny")
            fake.on_abort = pool.pause
            fake.script = [
                Step([(100, -0.11), (101, -0.12)], finish="abort"),
                Step([(102, -0.21)], finish="abort"),
                Step([(103, -0.31), (151645, -0.32)], finish="stop", matched=151645),
            ]
            params = SamplingParams(max_new_tokens=10, banned_token_ids=BANNED)
            task = asyncio.create_task(pool.generate(ids, params, session_id="vis", images=images))
            await update_cycle(pool, 1)
            await update_cycle(pool, 2)
            gen = await task
            await pool.close()
            return fake, gen

    fake, gen = run(go())
    lp = lambda v, pos: default_lp(v, pos, 0)  # noqa: E731
    assert gen.output_ids == [100, 101, 102, 103, 151645]
    assert gen.versions == [0, 0, 1, 2, 2]
    assert gen.proximal_logprobs_t == [lp(1, p0), lp(1, p0 + 1), lp(2, p0 + 2), -0.31, -0.32]
    assert gen.proximal_versions == [1, 1, 2, 2, 2]
    assert gen.prompt_tokens == p0
    outputs = [[], [100, 101], [100, 101, 102]]
    if kind == "sglang":
        reqs = fake.requests
        assert [r["input_ids"] for r in reqs] == [collapsed(ids) + o for o in outputs]
        assert [r["image_data"] for r in reqs] == [[url(RED), url(GREEN)]] * 3
        assert [r["logprob_start_len"] for r in reqs] == [-1, p0 - 1, p0 - 1]
        assert all(set(r["sampling_params"]["logit_bias"]) == {str(t) for t in BANNED} for r in reqs)
    else:
        reqs = fake.generate_requests
        assert not fake.requests  # nothing went to /v1/completions
        assert [r["token_ids"] for r in reqs] == [collapsed(ids) + o for o in outputs]
        assert [[p["url"] for p in r["content_parts"]] for r in reqs] == [[url(RED), url(GREEN)]] * 3
        assert ["prompt_logprobs" in r["sampling_params"] for r in reqs] == [False, True, True]


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
@pytest.mark.parametrize("where", ["inside", "after"])
def test_prefill_with_images_gives_the_engines_values_at_expanded_positions(kind, where):
    ids, images = prompt(HEAD, RED, [300, 301], BLUE, [302, 303, 304], TAIL)
    start = images[1].offset + 2 if where == "inside" else images[1].offset + images[1].length + 1

    async def go():
        with respx.mock(assert_all_called=False) as router:
            if kind == "sglang":
                fake = FakeSGLang(router, A, version="3")
                fake.script = [Step([], finish="length")]
                pool = make_pool(version=3)
            else:
                fake = FakeVLLM(router, A, version=3)
                fake.weight_version = "3"
                fake.script = [Step([(7, -0.5)], finish="length")]
                pool = make_pool("vllm", version=3)
            values = await pool.prefill_logprobs(ids, start, session_id="r2", images=images)
            await pool.close()
            return fake, values

    fake, values = run(go())
    assert values == [default_lp(3, p, 0) for p in range(start, len(ids))]
    if kind == "sglang":
        assert fake.requests[0]["logprob_start_len"] == start - 1
        assert fake.requests[0]["image_data"] == [url(RED), url(BLUE)]
    else:
        assert fake.generate_requests[0]["sampling_params"]["prompt_logprobs"] == 0


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_engine_with_other_pixel_limits_is_a_clear_error_not_a_misplaced_turn(kind):
    ids, images = prompt(HEAD, GREEN, TAIL)  # 77 pads with max_pixels 256*28*28

    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeSGLang(router, A) if kind == "sglang" else FakeVLLM(router, A)
            fake.pixels = {"min_pixels": 4 * 28 * 28, "max_pixels": 64 * 28 * 28}
            fake.script = [Step([(5, -1.0)])]
            pool = make_pool(kind)
            try:
                await pool.generate(ids, SamplingParams(max_new_tokens=4), session_id="m", images=images)
            finally:
                await pool.close()

    with pytest.raises(EngineBadResponse, match="image processor") as err:
        run(go())
    assert err.value.retryable is False


def test_text_only_generation_through_the_pool_sends_no_image_keys():
    ids = HEAD + [5, 6, 7] + TAIL

    async def go():
        with respx.mock(assert_all_called=False) as router:
            sg = FakeSGLang(router, A)
            sg.script = [Step([(9, -0.3)])]
            pool = make_pool()
            await pool.generate(ids, SamplingParams(max_new_tokens=3), session_id="t")
            await pool.close()
            return sg.requests[0]

    body = run(go())
    assert "image_data" not in body and "logit_bias" not in body["sampling_params"] and body["input_ids"] == ids


def test_a_banned_id_out_of_the_vocabulary_is_refused_by_the_engine():
    ids, images = prompt(HEAD, BLUE, TAIL)

    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeSGLang(router, A)
            fake.script = [Step([(5, -1.0)])]
            pool = make_pool()
            try:
                await pool.generate(ids, SamplingParams(banned_token_ids=(999_999,)), session_id="b", images=images)
            finally:
                await pool.close()

    with pytest.raises(EngineRejected, match="logit_bias must has keys"):
        run(go())


def test_request_body_images_are_data_urls_of_the_original_bytes():
    ids, images = prompt(HEAD, RED, TAIL)

    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeSGLang(router, A)
            fake.script = [Step([(5, -1.0)])]
            pool = make_pool()
            await pool.generate(ids, SamplingParams(max_new_tokens=1), session_id="d", images=images)
            await pool.close()
            return fake.requests[0]

    body = run(go())
    head, b64 = body["image_data"][0].split(",", 1)
    import base64

    assert head == "data:image/png;base64" and base64.b64decode(b64) == RED
    assert json.dumps(body["input_ids"]).count(str(PAD)) == 1


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_streamed_generation_with_images_survives_an_abort_and_delivers_each_token_once(kind):
    ids, images = prompt(HEAD, BLUE, [9, 9], RED, TAIL)
    p0 = len(ids)
    seen: list[int] = []

    async def on_tokens(new, lps):
        seen.extend(new)

    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeSGLang(router, A, version="0") if kind == "sglang" else FakeVLLM(router, A, version=0)
            pool = make_pool(kind, **({"model": "tiny"} if kind == "vllm" else {}))
            fake.on_abort = pool.pause
            fake.script = [Step([(1, -0.1), (2, -0.2)], finish="abort"), Step([(3, -0.3), (4, -0.4)], finish="stop")]
            task = asyncio.create_task(
                pool.generate(ids, SamplingParams(max_new_tokens=9), session_id="st", on_tokens=on_tokens, images=images)
            )
            await update_cycle(pool, 1)
            gen = await task
            await pool.close()
            return fake, gen

    fake, gen = run(go())
    assert seen == [1, 2, 3, 4] == gen.output_ids
    assert gen.versions == [0, 0, 1, 1] and gen.proximal_versions == [1, 1, 1, 1]
    assert gen.proximal_logprobs_t[:2] == [default_lp(1, p0, 0), default_lp(1, p0 + 1, 0)]
    reqs = fake.requests if kind == "sglang" else fake.generate_requests
    # vLLM's stream has no prompt logprobs: the resume that owes them runs unstreamed
    assert [r["stream"] for r in reqs] == ([True, True] if kind == "sglang" else [True, False])


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_next_turn_prompt_logprobs_with_images_come_at_expanded_positions(kind):
    """R2 on an open session's next turn: the turn's own call returns the prompt's input
    logprobs from the first owed position, which lies after an image of the new user turn."""
    ids, images = prompt(HEAD, RED, [40, 41, 42, 43], BLUE, [44, 45], TAIL)
    owed_from = images[0].offset + images[0].length + 2

    async def go():
        with respx.mock(assert_all_called=False) as router:
            if kind == "sglang":
                fake = FakeSGLang(router, A, version="5")
                pool = make_pool(version=5)
            else:
                fake = FakeVLLM(router, A, version=5)
                fake.weight_version = "5"
                pool = make_pool("vllm", version=5)
            fake.script = [Step([(8, -0.8)], finish="stop", matched=8)]
            gen = await pool.generate(ids, SamplingParams(max_new_tokens=4), session_id="n", images=images,
                                      prompt_logprobs_from=owed_from)
            await pool.close()
            return gen

    gen = run(go())
    assert gen.prompt_logprobs_start == owed_from and gen.prompt_logprobs_version == 5
    assert gen.prompt_logprobs == [default_lp(5, p, 0) for p in range(owed_from, len(ids))]
