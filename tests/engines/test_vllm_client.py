"""vLLM wire client: exact ``/v1/completions`` bodies and parsing of vLLM-shaped replies."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import respx

from engine_fakes import FakeVLLM, Step, vllm_reply
from engines.types import EngineBadResponse, EngineUnsupported, SamplingParams
from engines.vllm import VLLMClient, completion_payload, parse_completion

URL = "http://vllm-a:8000"
PROMPT = [151644, 872, 198, 9707]


def run(coro):
    return asyncio.run(coro)


def test_payload_without_owed_logprobs_has_no_echo():
    body = completion_payload(PROMPT, SamplingParams(max_new_tokens=9), model="tiny", echo=False, stream=False)
    assert body == {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 9,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
        "skip_special_tokens": False,
        "stream": False,
    }


def test_payload_with_echo_stops_and_stream():
    params = SamplingParams(max_new_tokens=4, stop=("\n\n",), stop_token_ids=(151645,))
    body = completion_payload(PROMPT, params, model="tiny", echo=True, stream=True)
    assert body["echo"] is True and body["stream"] is True
    assert body["stop"] == ["\n\n"] and body["stop_token_ids"] == [151645]
    assert body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 4  # always sent: vLLM's default is 16


def test_parse_token_id_strings_and_minus_9999():
    reply = vllm_reply(PROMPT, Step([(11, -0.5), (12, -9999.0), (151645, -0.1)], finish="stop"), cached=3)
    seg = parse_completion(reply, PROMPT, echo=False, replica=URL)
    assert seg.output_ids == [11, 12, 151645]
    assert seg.logprobs == [-0.5, -9999.0, -0.1]  # vLLM's -inf clamp is kept as is
    assert seg.finish_reason == "stop" and seg.matched_stop == 151645  # EOS: stop_reason null
    assert seg.input_logprobs == [] and seg.cached_tokens == 3 and seg.prompt_tokens == 4


def test_parse_echo_splits_prompt_logprobs_with_null_first():
    reply = vllm_reply(PROMPT, Step([(11, -0.5)], finish="length"), echo=True, prefill=lambda p: -float(p))
    assert reply["choices"][0]["logprobs"]["token_logprobs"][0] is None
    seg = parse_completion(reply, PROMPT, echo=True, replica=URL)
    assert seg.input_logprobs_start == 0
    assert seg.input_logprobs == [None, -1.0, -2.0, -3.0]
    assert seg.output_ids == [11] and seg.logprobs == [-0.5]


def test_parse_stop_string_and_abort():
    seg = parse_completion(vllm_reply(PROMPT, Step([(5, -1.0)]), stop_reason="</tool_call>"), PROMPT, echo=False, replica=URL)
    assert seg.matched_stop == "</tool_call>"
    seg = parse_completion(vllm_reply(PROMPT, Step([(5, -1.0), (6, -2.0)], finish="abort")), PROMPT, echo=False, replica=URL)
    assert seg.finish_reason == "abort" and seg.output_ids == [5, 6] and seg.matched_stop is None


def test_parse_rejects_mismatched_ids_and_bad_tokens():
    reply = vllm_reply(PROMPT, Step([(5, -1.0)]))
    reply["choices"][0]["token_ids"] = [6]
    with pytest.raises(EngineBadResponse, match="token_ids"):
        parse_completion(reply, PROMPT, echo=False, replica=URL)
    reply = vllm_reply(PROMPT, Step([(5, -1.0)]))
    reply["choices"][0]["logprobs"]["tokens"] = ["hello"]
    with pytest.raises(EngineBadResponse, match="token_id"):
        parse_completion(reply, PROMPT, echo=False, replica=URL)


def test_generate_and_stream_over_http():
    async def go():
        got = []

        async def on_tokens(ids, lps):
            got.append((ids, lps))

        with respx.mock(assert_all_called=False) as router:
            fake = FakeVLLM(router, URL)
            fake.script = [Step([(7, -0.7), (8, -0.8)], finish="length"), Step([(9, -0.9), (10, -1.0)], finish="stop")]
            async with httpx.AsyncClient() as http:
                c = VLLMClient(http, URL, model="tiny")
                plain = await c.generate(PROMPT, SamplingParams(max_new_tokens=2), rid="x")
                streamed = await c.generate(PROMPT, SamplingParams(max_new_tokens=2), rid="y", input_logprobs_from=2, on_tokens=on_tokens)
        return fake, plain, streamed, got

    fake, plain, streamed, got = run(go())
    assert "echo" not in fake.requests[0] and fake.requests[0]["stream"] is False
    assert fake.requests[1]["echo"] is True and fake.requests[1]["stream"] is True
    assert plain.output_ids == [7, 8] and plain.finish_reason == "length"
    assert got == [([9], [-0.9]), ([10], [-1.0])]  # the echoed prompt is never streamed as output
    assert streamed.output_ids == [9, 10] and streamed.input_logprobs[0] is None
    assert len(streamed.input_logprobs) == len(PROMPT)


def test_prefill_uses_max_tokens_1_and_echo():
    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeVLLM(router, URL, version=0)
            fake.prefill_lp = lambda v, pos, tok: -10.0 - pos
            fake.script = [Step([(1, -0.1)], finish="length")]
            async with httpx.AsyncClient() as http:
                values, wv = await VLLMClient(http, URL, model="tiny").prefill(PROMPT, 2)
        return fake, values, wv

    fake, values, wv = run(go())
    assert fake.requests[0]["max_tokens"] == 1 and fake.requests[0]["echo"] is True
    assert values == [-12.0, -13.0] and wv is None


def test_admin_paths_and_no_weight_loading():
    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeVLLM(router, URL)
            async with httpx.AsyncClient() as http:
                c = VLLMClient(http, URL)
                await c.pause()
                await c.resume()
                with pytest.raises(EngineUnsupported, match="no standard HTTP endpoint"):
                    await c.update_weights("/ckpt", 1)
                return fake.admin, await c.served_model(), await c.health()

    admin, model, healthy = run(go())
    assert admin == ["/pause?mode=abort", "/resume"]
    assert model == "tiny" and healthy is True
