"""SGLang wire client: exact request bodies and parsing of SGLang-shaped replies."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import respx

from tests.fakes.engines import FakeSGLang, Step, sglang_reply, sse
from engines.http_transport import EngineTransport
from engines.sglang import SGLangClient, generate_payload, parse_response
from engines.types import EngineBadResponse, EngineRejected, SamplingParams

URL = "http://sglang-a:30000"
PROMPT = [151644, 872, 198, 9707]


def run(coro):
    return asyncio.run(coro)


def test_payload_without_owed_logprobs_is_exact():
    body = generate_payload(PROMPT, SamplingParams(max_new_tokens=7), rid="r1", logprob_start_len=-1, stream=False)
    assert body == {
        "input_ids": PROMPT,
        "sampling_params": {
            "max_new_tokens": 7,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "skip_special_tokens": False,
            "no_stop_trim": True,
        },
        "return_logprob": True,
        "logprob_start_len": -1,
        "rid": "r1",
        "stream": False,
    }


def test_payload_with_stops_only_adds_known_keys():
    params = SamplingParams(max_new_tokens=3, temperature=0.7, top_p=0.9, top_k=20, stop=("</answer>",), stop_token_ids=(151645,))
    sp = generate_payload(PROMPT, params, rid="r", logprob_start_len=3, stream=True)["sampling_params"]
    assert set(sp) == {"max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "skip_special_tokens", "no_stop_trim"}
    assert sp["stop"] == ["</answer>"] and sp["stop_token_ids"] == [151645]
    assert sp["temperature"] == 0.7 and sp["top_k"] == 20


def test_generate_sends_minus_one_when_nothing_owed_and_parses_reply():
    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeSGLang(router, URL, version="3")
            fake.cached = 2
            fake.script = [Step([(9, -0.25), (151645, -0.01)], finish="stop", matched=151645)]
            async with httpx.AsyncClient(transport=EngineTransport()) as http:
                seg = await SGLangClient(http, URL).generate(PROMPT, SamplingParams(max_new_tokens=5), rid="abc")
            return fake, seg

    fake, seg = run(go())
    sent = fake.requests[0]
    assert sent["logprob_start_len"] == -1 and sent["rid"] == "abc" and sent["stream"] is False
    assert sent["return_logprob"] is True and sent["sampling_params"]["max_new_tokens"] == 5
    assert seg.output_ids == [9, 151645] and seg.logprobs == [-0.25, -0.01]
    assert seg.finish_reason == "stop" and seg.matched_stop == 151645
    assert seg.input_logprobs == [] and seg.weight_version == "3"
    assert seg.prompt_tokens == 4 and seg.cached_tokens == 2


def test_input_logprobs_are_indexed_by_absolute_position_with_null_first():
    reply = sglang_reply(PROMPT, Step([(5, -0.5)]), logprob_start_len=1, prefill=lambda p: -float(p))
    assert reply["meta_info"]["input_token_logprobs"][0] == [None, PROMPT[1], None]
    seg = parse_response(reply, PROMPT, 1, URL)
    assert seg.input_logprobs_start == 1
    assert seg.input_logprobs == [None, -2.0, -3.0]  # positions 1, 2, 3


def test_input_logprob_for_the_wrong_token_is_an_error():
    reply = sglang_reply(PROMPT, Step([(5, -0.5)]), logprob_start_len=1)
    reply["meta_info"]["input_token_logprobs"][2][1] = 42  # entry 2 is position 3, not token 42
    with pytest.raises(EngineBadResponse, match="position 3"):
        parse_response(reply, PROMPT, 1, URL)


def test_stop_string_match_and_abort_with_partial_output():
    seg = parse_response(sglang_reply(PROMPT, Step([(1, -1.0)], matched="</answer>")), PROMPT, -1, URL)
    assert seg.matched_stop == "</answer>"
    seg = parse_response(sglang_reply(PROMPT, Step([(1, -1.0), (2, -2.0)], finish="abort")), PROMPT, -1, URL)
    assert seg.finish_reason == "abort" and seg.output_ids == [1, 2] and seg.matched_stop is None
    queued = sglang_reply(PROMPT, Step([], finish="abort"), logprob_start_len=2)
    seg = parse_response(queued, PROMPT, 2, URL)
    assert seg.output_ids == [] and seg.input_logprobs == [] and seg.finish_reason == "abort"


def test_weight_version_spans_are_parsed():
    reply = sglang_reply(PROMPT, Step([(1, -1.0), (2, -2.0), (3, -3.0)]), weight_version="5")
    reply["meta_info"]["weight_versions"] = [{"start": 0, "end": 1, "version": "4"}, {"start": 1, "end": 3, "version": "5"}]
    seg = parse_response(reply, PROMPT, -1, URL)
    assert seg.weight_version_spans == ((0, 1, "4"), (1, 3, "5"))


def test_non_finite_logprobs_map_to_minus_9999():
    raw = json.dumps(sglang_reply(PROMPT, Step([(1, float("-inf"))]))).encode()
    assert b"-Infinity" in raw

    async def go():
        with respx.mock() as router:
            router.post(f"{URL}/generate").mock(return_value=httpx.Response(200, content=raw))
            async with httpx.AsyncClient(transport=EngineTransport()) as http:
                return await SGLangClient(http, URL).generate(PROMPT, SamplingParams(), rid="r")

    assert run(go()).logprobs == [-9999.0]


def test_streaming_yields_new_tokens_from_cumulative_frames():
    async def go():
        got: list[tuple[list[int], list[float]]] = []

        async def on_tokens(ids, lps):
            got.append((ids, lps))

        with respx.mock(assert_all_called=False) as router:
            fake = FakeSGLang(router, URL)
            fake.script = [Step([(7, -0.7), (8, -0.8), (9, -0.9)], finish="length")]
            async with httpx.AsyncClient(transport=EngineTransport()) as http:
                seg = await SGLangClient(http, URL).generate(PROMPT, SamplingParams(max_new_tokens=3), rid="s", on_tokens=on_tokens)
        return fake, got, seg

    fake, got, seg = run(go())
    assert fake.requests[0]["stream"] is True
    assert got == [([7], [-0.7]), ([8], [-0.8]), ([9], [-0.9])]
    assert seg.output_ids == [7, 8, 9] and seg.finish_reason == "length"


def test_stream_error_frame_raises():
    async def go():
        with respx.mock() as router:
            body = sse([{"error": {"message": "out of memory", "code": 500}}])
            router.post(f"{URL}/generate").mock(return_value=httpx.Response(200, content=body))
            router.post(f"{URL}/abort_request").mock(return_value=httpx.Response(200))

            async def cb(ids, lps):
                pass

            async with httpx.AsyncClient(transport=EngineTransport()) as http:
                await SGLangClient(http, URL).generate(PROMPT, SamplingParams(), rid="e", on_tokens=cb)

    with pytest.raises(EngineBadResponse, match="out of memory"):
        run(go())


def test_cancellation_sends_abort_request_for_the_rid():
    async def go():
        started = asyncio.Event()
        with respx.mock(assert_all_called=False) as router:

            async def slow(request):
                started.set()
                await asyncio.sleep(30)
                return httpx.Response(200)

            router.post(f"{URL}/generate").mock(side_effect=slow)
            abort = router.post(f"{URL}/abort_request").mock(return_value=httpx.Response(200))
            async with httpx.AsyncClient(transport=EngineTransport()) as http:
                task = asyncio.create_task(SGLangClient(http, URL).generate(PROMPT, SamplingParams(), rid="gone-1"))
                await started.wait()
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            return [json.loads(c.request.content) for c in abort.calls]

    assert run(go()) == [{"rid": "gone-1"}]


def test_admin_calls_are_exact():
    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeSGLang(router, URL, version="0")
            async with httpx.AsyncClient(transport=EngineTransport()) as http:
                c = SGLangClient(http, URL)
                await c.pause()
                await c.update_weights("/ckpt/step-7", 7)
                version = await c.weight_version()
                await c.resume()
                healthy = await c.health()
                fake.update_ok = False
                with pytest.raises(EngineRejected, match="no such file"):
                    await c.update_weights("/missing", 8)
            return fake, version, healthy

    fake, version, healthy = run(go())
    assert fake.admin[:3] == [
        ("/pause_generation", {"mode": "abort"}),
        ("/update_weights_from_disk", {"model_path": "/ckpt/step-7", "weight_version": "7", "flush_cache": True}),
        ("/continue_generation", {}),
    ]
    assert version == "7" and healthy is True


def test_routing_key_header_is_safe_ascii():
    from engines.sglang import routing_value

    assert routing_value("session-42") == "session-42"
    hashed = routing_value("sessión\n1")
    assert hashed.isascii() and len(hashed) == 32 and hashed == routing_value("sessión\n1")
