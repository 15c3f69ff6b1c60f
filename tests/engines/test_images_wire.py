"""Engine wire formats for prompts with images, against replies shaped exactly like the
released servers' (SGLang 0.5.23 ``/generate``, vLLM 0.32 ``/inference/v1/generate``;
docs/engines.md, "Images")."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import respx

from engines.http_transport import EngineTransport
from engines.sglang import SGLangClient
from engines.types import EngineBadResponse, EngineUnsupported, SamplingParams
from engines.vllm import VLLMClient
from tests.engines.image_cases import BANNED, BLUE, HEAD, RED, TAIL, collapsed, grid, prompt, url

S = "http://sglang:30000"
V = "http://vllm:8000"
PAD = 151655
BIAS = {"151652": -100.0, "151653": -100.0, "151654": -100.0, "151655": -100.0, "151656": -100.0}


def run(coro):
    return asyncio.run(coro)


def sglang_meta(prompt_tokens, out, *, inputs=(), version="3", finish=None):
    return {
        "id": "rid",
        "finish_reason": finish or {"type": "stop", "matched": out[-1][0] if out else None},
        "prompt_tokens": prompt_tokens,
        "weight_version": version,
        "total_retractions": 0,
        "completion_tokens": len(out),
        "cached_tokens": 0,
        "input_token_logprobs": list(inputs),
        "output_token_logprobs": [[lp, t, None] for t, lp in out],
        "e2e_latency": 0.02,
    }


def sglang_body(prompt_tokens, out, **kw):
    return {"text": "x", "output_ids": [t for t, _ in out], "meta_info": sglang_meta(prompt_tokens, out, **kw)}


# -- SGLang ---------------------------------------------------------------------------------------


def test_images_fixture_is_the_processors_expansion():
    ids, images = prompt(HEAD, RED, [1234], BLUE, TAIL)
    assert grid(RED) == (1, 8, 10) and grid(BLUE) == (1, 4, 4)
    assert [(i.offset, i.length) for i in images] == [(4, 20), (27, 4)]
    assert ids[4:24] == [PAD] * 20 and ids[3] == 151652 and ids[24] == 151653


def test_sglang_generate_sends_collapsed_pads_and_data_urls_in_prompt_order():
    ids, images = prompt(HEAD, RED, [1234, 5678], BLUE, TAIL)
    out = [(9001, -0.4), (151645, -0.2)]

    async def go():
        with respx.mock() as router:
            route = router.post(f"{S}/generate").mock(return_value=httpx.Response(200, json=sglang_body(len(ids), out)))
            async with httpx.AsyncClient(transport=EngineTransport()) as http:
                seg = await SGLangClient(http, S).generate(
                    ids, SamplingParams(max_new_tokens=8, banned_token_ids=BANNED), rid="r-1", images=images
                )
            return json.loads(route.calls[0].request.content), seg

    body, seg = run(go())
    assert body == {
        "input_ids": collapsed(ids),
        "image_data": [url(RED), url(BLUE)],
        "sampling_params": {
            "max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
            "skip_special_tokens": False, "no_stop_trim": True, "logit_bias": BIAS,
        },
        "return_logprob": True,
        "logprob_start_len": -1,
        "rid": "r-1",
        "stream": False,
    }
    assert body["input_ids"].count(PAD) == 2 and len(body["input_ids"]) == len(ids) - 22
    assert seg.output_ids == [9001, 151645] and seg.logprobs == [-0.4, -0.2] and seg.prompt_tokens == len(ids)


def test_sglang_text_only_request_has_no_image_or_bias_keys():
    ids = HEAD + [1, 2, 3] + TAIL

    async def go():
        with respx.mock() as router:
            route = router.post(f"{S}/generate").mock(
                return_value=httpx.Response(200, json=sglang_body(len(ids), [(7, -1.0)]))
            )
            async with httpx.AsyncClient(transport=EngineTransport()) as http:
                await SGLangClient(http, S).generate(ids, SamplingParams(max_new_tokens=4), rid="t")
            return route.calls[0].request.content

    raw = run(go())
    body = json.loads(raw)
    assert list(body) == ["input_ids", "sampling_params", "return_logprob", "logprob_start_len", "rid", "stream"]
    assert list(body["sampling_params"]) == ["max_new_tokens", "temperature", "top_p", "top_k", "skip_special_tokens", "no_stop_trim"]
    assert body["input_ids"] == ids


def test_sglang_prompt_length_mismatch_is_a_clear_non_retryable_error():
    ids, images = prompt(HEAD, RED, TAIL)

    async def go():
        with respx.mock() as router:
            # the engine's processor made 30 pads of the image (other max_pixels)
            router.post(f"{S}/generate").mock(return_value=httpx.Response(200, json=sglang_body(len(ids) + 10, [(5, -1.0)])))
            async with httpx.AsyncClient(transport=EngineTransport()) as http:
                await SGLangClient(http, S).generate(ids, SamplingParams(), rid="r", images=images)

    with pytest.raises(EngineBadResponse) as err:
        run(go())
    assert "image processor" in str(err.value) and f"to {len(ids) + 10} tokens" in str(err.value)
    assert err.value.retryable is False


@pytest.mark.parametrize("start_at", ["inside", "after"])
def test_sglang_prefill_positions_are_expanded_and_image_ids_read_as_zero(start_at):
    ids, images = prompt(HEAD, RED, [300, 301, 302], TAIL)
    img = images[0]
    start = img.offset + 5 if start_at == "inside" else img.offset + img.length + 2
    lsl = start - 1
    # SGLang: one entry per position lsl..L-1, the first null; image positions carry id 0
    values = {p: -round(0.1 + p / 1000, 6) for p in range(len(ids))}
    inputs = [
        [None if j == 0 else values[p], 0 if img.offset <= p < img.offset + img.length else ids[p], None]
        for j, p in enumerate(range(lsl, len(ids)))
    ]

    async def go():
        with respx.mock() as router:
            route = router.post(f"{S}/generate").mock(
                return_value=httpx.Response(
                    200, json=sglang_body(len(ids), [], inputs=inputs, finish={"type": "length", "length": 0})
                )
            )
            async with httpx.AsyncClient(transport=EngineTransport()) as http:
                got = await SGLangClient(http, S).prefill(ids, start, images=images)
            return json.loads(route.calls[0].request.content), got

    body, (lps, version) = run(go())
    assert body["logprob_start_len"] == lsl and body["sampling_params"]["max_new_tokens"] == 0
    assert body["input_ids"] == collapsed(ids) and body["image_data"] == [url(RED)]
    assert lps == [values[p] for p in range(start, len(ids))] and version == "3"


def test_sglang_misplaced_input_logprob_outside_an_image_still_fails():
    ids, images = prompt(HEAD, RED, [300, 301], TAIL)
    start = len(ids) - 3
    inputs = [[None if j == 0 else -1.0, ids[p] + (1 if j == 2 else 0), None] for j, p in enumerate(range(start - 1, len(ids)))]

    async def go():
        with respx.mock() as router:
            router.post(f"{S}/generate").mock(
                return_value=httpx.Response(200, json=sglang_body(len(ids), [], inputs=inputs, finish={"type": "length"}))
            )
            async with httpx.AsyncClient(transport=EngineTransport()) as http:
                await SGLangClient(http, S).prefill(ids, start, images=images)

    with pytest.raises(EngineBadResponse, match="expected"):
        run(go())


def test_sglang_stream_checks_the_expansion_before_passing_tokens_on():
    ids, images = prompt(HEAD, BLUE, TAIL)
    seen = []

    async def on_tokens(new, lps):
        seen.extend(new)

    frames = [sglang_body(len(ids) + 4, [(5, -1.0)], finish={"type": "length"})]
    frames[0]["meta_info"]["finish_reason"] = None
    payload = b"".join(b"data: " + json.dumps(f).encode() + b"\n\n" for f in frames) + b"data: [DONE]\n\n"

    async def go():
        with respx.mock() as router:
            router.post(f"{S}/generate").mock(return_value=httpx.Response(200, content=payload))
            router.post(f"{S}/abort_request").mock(return_value=httpx.Response(200))
            async with httpx.AsyncClient(transport=EngineTransport()) as http:
                await SGLangClient(http, S).generate(ids, SamplingParams(), rid="r", on_tokens=on_tokens, images=images)

    with pytest.raises(EngineBadResponse, match="image processor"):
        run(go())
    assert seen == []


def test_spans_that_are_not_pad_runs_are_refused_before_sending():
    ids, images = prompt(HEAD, RED, TAIL)
    ids[images[0].offset + 3] = 42

    async def go():
        with respx.mock(assert_all_called=False) as router:
            route = router.post(f"{S}/generate")
            async with httpx.AsyncClient(transport=EngineTransport()) as http:
                try:
                    await SGLangClient(http, S).generate(ids, SamplingParams(), rid="r", images=images)
                finally:
                    assert not route.called

    with pytest.raises(ValueError, match="not a run"):
        run(go())


# -- vLLM -----------------------------------------------------------------------------------------


def vllm_content(t, lp):
    return {"token_id": t, "logprob": lp, "rank": 1, "top_logprobs": [{"token_id": t, "logprob": lp, "rank": 1}]}


def vllm_body(ids, images, out, *, prompt_lps=None, finish="stop", stop_reason=None, version="5"):
    return {
        "request_id": "generate-tokens-r-2",
        "model": "tiny",
        "created": 1700000000,
        "usage": {"prompt_tokens": len(ids), "total_tokens": len(ids) + len(out), "completion_tokens": len(out),
                  "prompt_tokens_details": None},
        "prompt_logprobs": prompt_lps,
        "prompt_token_id_logprobs": None,
        "prompt_token_ids": ids,
        "mm_placeholders": {"image": [{"offset": i.offset, "length": i.length} for i in images]},
        "metrics": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "output_mode": "tokens",
        "choices": [
            {
                "index": 0,
                "finish_reason": finish,
                "stop_reason": stop_reason,
                "token_ids": [t for t, _ in out],
                "routed_experts": None,
                "sampling_mask": None,
                "weight_versions": [{"version": version, "start": 0, "end": len(out)}],
                "logprobs": {"content": [vllm_content(t, lp) for t, lp in out]},
            }
        ],
    }


def test_vllm_images_go_to_inference_generate_with_content_parts():
    ids, images = prompt(HEAD, RED, [1234], BLUE, TAIL)
    out = [(9001, -0.4), (151645, -0.2)]

    async def go():
        with respx.mock(assert_all_called=False) as router:
            route = router.post(f"{V}/inference/v1/generate").mock(
                return_value=httpx.Response(200, json=vllm_body(ids, images, out))
            )
            completions = router.post(f"{V}/v1/completions")
            async with httpx.AsyncClient(transport=EngineTransport()) as http:
                seg = await VLLMClient(http, V, model="tiny").generate(
                    ids, SamplingParams(max_new_tokens=8, stop=("</s>",), banned_token_ids=BANNED), rid="r-2", images=images
                )
            assert not completions.called
            return json.loads(route.calls[0].request.content), seg

    body, seg = run(go())
    assert body == {
        "model": "tiny",
        "request_id": "r-2",
        "token_ids": collapsed(ids),
        "content_parts": [{"type": "image_url", "url": url(RED)}, {"type": "image_url", "url": url(BLUE)}],
        "sampling_params": {
            "max_tokens": 8, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": 0,
            "skip_special_tokens": False, "stop": ["</s>"], "logit_bias": BIAS,
        },
        "return_token_ids": True,
        "stream": False,
    }
    assert seg.output_ids == [9001, 151645] and seg.logprobs == [-0.4, -0.2]
    assert seg.finish_reason == "stop" and seg.matched_stop == 151645 and seg.prompt_tokens == len(ids)
    assert seg.weight_version_spans == ((0, 2, "5"),) and seg.input_logprobs == []


def test_vllm_text_only_stays_on_completions_and_carries_the_ban():
    ids = HEAD + [1, 2] + TAIL
    reply = {
        "id": "cmpl-1", "object": "text_completion", "created": 0, "model": "tiny",
        "choices": [{"index": 0, "text": "x", "logprobs": {"text_offset": [0], "token_logprobs": [-0.5],
                     "tokens": ["token_id:7"], "top_logprobs": [{"token_id:7": -0.5}]},
                     "finish_reason": "length", "stop_reason": None, "prompt_logprobs": None,
                     "prompt_token_ids": ids, "token_ids": [7]}],
        "usage": {"prompt_tokens": len(ids), "total_tokens": len(ids) + 1, "completion_tokens": 1, "prompt_tokens_details": None},
    }

    async def go():
        with respx.mock() as router:
            route = router.post(f"{V}/v1/completions").mock(return_value=httpx.Response(200, json=reply))
            async with httpx.AsyncClient(transport=EngineTransport()) as http:
                client = VLLMClient(http, V, model="tiny")
                await client.generate(ids, SamplingParams(max_new_tokens=1), rid="")
                await client.generate(ids, SamplingParams(max_new_tokens=1, banned_token_ids=BANNED), rid="")
            return [json.loads(c.request.content) for c in route.calls]

    plain, banned = run(go())
    assert "logit_bias" not in plain and "content_parts" not in plain and plain["prompt"] == ids
    assert banned == {**plain, "logit_bias": BIAS}


def test_vllm_prefill_with_images_reads_prompt_logprobs_by_token_key():
    ids, images = prompt(HEAD, RED, [300, 301, 302], TAIL)
    img = images[0]
    start = img.offset + 7  # inside the image span
    values = {p: -round(0.2 + p / 1000, 6) for p in range(len(ids))}
    # prompt_logprobs: 0 -> one map per position holding the prompt's own id (JSON keys are strings)
    prompt_lps = [None] + [{str(ids[p]): {"logprob": values[p], "rank": 3, "decoded_token": None}} for p in range(1, len(ids))]

    async def go():
        with respx.mock() as router:
            route = router.post(f"{V}/inference/v1/generate").mock(
                return_value=httpx.Response(200, json=vllm_body(ids, images, [(11, -0.9)], prompt_lps=prompt_lps, finish="length"))
            )
            async with httpx.AsyncClient(transport=EngineTransport()) as http:
                got = await VLLMClient(http, V).prefill(ids, start, images=images)
            return json.loads(route.calls[0].request.content), got

    body, (lps, _) = run(go())
    assert body["sampling_params"]["prompt_logprobs"] == 0 and body["sampling_params"]["max_tokens"] == 1
    assert "model" not in body and "request_id" not in body
    assert lps == [values[p] for p in range(start, len(ids))]


def test_vllm_placeholder_mismatch_is_a_clear_error():
    ids, images = prompt(HEAD, RED, TAIL)
    body = vllm_body(ids, images, [(5, -1.0)])
    body["mm_placeholders"]["image"][0]["length"] = 30
    body["usage"]["prompt_tokens"] = len(ids) + 10

    async def go():
        with respx.mock() as router:
            router.post(f"{V}/inference/v1/generate").mock(return_value=httpx.Response(200, json=body))
            async with httpx.AsyncClient(transport=EngineTransport()) as http:
                await VLLMClient(http, V).generate(ids, SamplingParams(), rid="r", images=images)

    with pytest.raises(EngineBadResponse, match=r"placed the images at \[\(4, 30\)\], Splice at \[\(4, 20\)\]") as err:
        run(go())
    assert err.value.retryable is False


def test_vllm_without_scale_out_names_the_flag():
    ids, images = prompt(HEAD, BLUE, TAIL)
    disabled = {"error": {"message": "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them.",
                          "type": "PermissionDeniedError", "param": None, "code": 403}}

    async def go():
        with respx.mock() as router:
            router.post(f"{V}/inference/v1/generate").mock(return_value=httpx.Response(403, json=disabled))
            async with httpx.AsyncClient(transport=EngineTransport()) as http:
                await VLLMClient(http, V).generate(ids, SamplingParams(), rid="r", images=images)

    with pytest.raises(EngineUnsupported, match="--enable-scale-out"):
        run(go())


def test_vllm_stream_with_images_and_an_unstreamed_call_when_prompt_logprobs_are_owed():
    ids, images = prompt(HEAD, BLUE, TAIL)
    out = [(21, -0.1), (22, -0.2), (151645, -0.3)]
    chunks = []
    for k, (t, lp) in enumerate(out):
        last = k == len(out) - 1
        chunk = {"request_id": "generate-tokens-1", "usage": None, "output_mode": "tokens",
                 "choices": [{"index": 0, "finish_reason": "stop" if last else None, "stop_reason": None,
                              "token_ids": [t], "routed_experts": None, "sampling_mask": None,
                              "weight_versions": [{"version": "2", "start": 0, "end": 3}] if last else None,
                              "logprobs": {"content": [vllm_content(t, lp)]}}]}
        if k == 0:
            chunk["prompt_token_ids"] = ids
            chunk["mm_placeholders"] = {"image": [{"offset": images[0].offset, "length": images[0].length}]}
        chunks.append(chunk)
    chunks.append({"request_id": "generate-tokens-1", "usage": {"prompt_tokens": len(ids), "total_tokens": len(ids) + 3,
                   "completion_tokens": 3}, "output_mode": "tokens", "choices": []})
    sse = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"
    prompt_lps = [None] + [{str(ids[p]): {"logprob": -1.0 - p, "rank": 1, "decoded_token": None}} for p in range(1, len(ids))]
    batches = []

    async def on_tokens(new, lps):
        batches.append((list(new), list(lps)))

    async def go():
        with respx.mock() as router:
            route = router.post(f"{V}/inference/v1/generate").mock(
                side_effect=[
                    httpx.Response(200, content=sse, headers={"content-type": "text/event-stream"}),
                    httpx.Response(200, json=vllm_body(ids, images, out, prompt_lps=prompt_lps)),
                ]
            )
            async with httpx.AsyncClient(transport=EngineTransport()) as http:
                client = VLLMClient(http, V)
                streamed = await client.generate(ids, SamplingParams(), rid="a", on_tokens=on_tokens, images=images)
                owed = await client.generate(ids, SamplingParams(), rid="b", on_tokens=on_tokens, images=images,
                                             input_logprobs_from=len(ids) - 2)
            return [json.loads(c.request.content) for c in route.calls], streamed, owed

    bodies, streamed, owed = run(go())
    assert bodies[0]["stream"] is True and bodies[0]["stream_options"] == {"include_usage": True}
    assert bodies[1]["stream"] is False and bodies[1]["sampling_params"]["prompt_logprobs"] == 0
    assert batches[:3] == [([21], [-0.1]), ([22], [-0.2]), ([151645], [-0.3])]
    assert batches[3] == ([21, 22, 151645], [-0.1, -0.2, -0.3])  # the unstreamed call, in one piece
    assert streamed.output_ids == owed.output_ids == [21, 22, 151645]
    assert streamed.weight_version_spans == ((0, 3, "2"),) and streamed.prompt_tokens == len(ids)
    assert owed.input_logprobs[0] is None and owed.input_logprobs[-1] == -1.0 - (len(ids) - 1)


# -- engines.images --------------------------------------------------------------------------------


def test_spans_out_of_order_overlapping_or_outside_are_refused():
    from engines.images import check_spans

    ids, images = prompt(HEAD, RED, [7], BLUE, TAIL)
    check_spans(ids, images)
    with pytest.raises(ValueError, match="out of order"):
        check_spans(ids, [images[1], images[0]])
    with pytest.raises(ValueError, match="out of order"):
        check_spans(ids, [images[0], images[0]])
    with pytest.raises(ValueError, match="outside"):
        check_spans(ids[: images[1].offset + 2], images)


def test_data_urls_are_cached_by_hash_within_a_byte_bound(monkeypatch):
    import base64
    import dataclasses

    import engines.images as wire

    _, images = prompt(HEAD, RED, BLUE, TAIL)
    monkeypatch.setattr(wire, "_url_cache", type(wire._url_cache)())
    monkeypatch.setattr(wire, "_url_cache_size", 0)
    red_url = "data:image/png;base64," + base64.b64encode(RED).decode()
    monkeypatch.setattr(wire, "_URL_CACHE_BYTES", len(red_url) + 10)  # room for one red image
    assert wire.data_url(images[0]) == red_url
    # same hash and mime: served from the cache (the bytes are not looked at again)
    assert wire.data_url(dataclasses.replace(images[0], data=b"")) == red_url
    wire.data_url(images[1])  # the blue image pushes the red one out
    assert wire._url_cache_size <= len(red_url) + 10
    assert wire.data_url(dataclasses.replace(images[0], data=b"")) == "data:image/png;base64,"
