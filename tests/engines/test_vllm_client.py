"""vLLM wire client: exact ``/v1/completions`` bodies and parsing of vLLM-shaped replies."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import respx

from tests.fakes.engines import FakeVLLM, Step, vllm_reply
from engines.http_transport import EngineTransport
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
            async with httpx.AsyncClient(transport=EngineTransport()) as http:
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
            async with httpx.AsyncClient(transport=EngineTransport()) as http:
                values, wv = await VLLMClient(http, URL, model="tiny").prefill(PROMPT, 2)
        return fake, values, wv

    fake, values, wv = run(go())
    assert fake.requests[0]["max_tokens"] == 1 and fake.requests[0]["echo"] is True
    assert values == [-12.0, -13.0] and wv is None


def test_admin_paths_without_dev_mode_name_the_setting():
    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeVLLM(router, URL, dev_mode=False)
            async with httpx.AsyncClient(transport=EngineTransport()) as http:
                c = VLLMClient(http, URL)
                for call in (c.pause(), c.resume(), c.update_weights("/ckpt", 1)):
                    with pytest.raises(EngineUnsupported, match="VLLM_SERVER_DEV_MODE=1"):
                        await call
                return fake.admin, await c.served_model(), await c.health(), await c.weight_version()

    admin, model, healthy, wv = run(go())
    assert admin == []
    assert model == "tiny" and healthy is True and wv is None


def test_dev_mode_pause_resume_paths():
    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeVLLM(router, URL)
            async with httpx.AsyncClient(transport=EngineTransport()) as http:
                c = VLLMClient(http, URL)
                await c.pause()
                await c.resume()
                return fake.admin

    assert run(go()) == ["/pause?mode=abort", "/resume"]


def test_update_weights_wire_shape_version_and_readback():
    """reload_weights through /collective_rpc with the path untouched, then the version."""

    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeVLLM(router, URL)
            async with httpx.AsyncClient(transport=EngineTransport()) as http:
                c = VLLMClient(http, URL, model="tiny")
                before = await c.weight_version()
                await c.update_weights("relative dir/ckpt v7", 7)  # the engine's path, never resolved here
                return fake, before, await c.weight_version()

    fake, before, after = run(go())
    assert fake.rpc == [{"method": "reload_weights", "kwargs": {"weights_path": "relative dir/ckpt v7"}}]
    assert fake.admin == ["/update_weight_version {'new_version': '7'}"]
    assert before == "default" and after == "7"


def test_update_weights_failure_raises_and_sets_no_version():
    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeVLLM(router, URL)
            fake.reload_error = "no such dir"
            async with httpx.AsyncClient(transport=EngineTransport()) as http:
                c = VLLMClient(http, URL)
                with pytest.raises(EngineBadResponse, match="collective_rpc: HTTP 500") as err:
                    await c.update_weights("/missing", 3)
                return fake, err.value

    fake, err = run(go())
    assert not any("update_weight_version" in a for a in fake.admin) and fake.weight_version == "default"
    assert err.retryable is False


def test_update_weights_reports_a_dead_engine_after_a_failed_reload():
    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeVLLM(router, URL)
            fake.reload_error = "boom"
            router.get(f"{URL}/health").mock(side_effect=httpx.ConnectError("refused"))
            async with httpx.AsyncClient(transport=EngineTransport()) as http:
                with pytest.raises(EngineBadResponse, match="kills its EngineCore"):
                    await VLLMClient(http, URL).update_weights("/bad", 1)

    run(go())


def test_update_weights_version_that_does_not_read_back_is_an_error():
    async def go():
        with respx.mock(assert_all_called=False) as router:
            FakeVLLM(router, URL).keep_version = True
            async with httpx.AsyncClient(transport=EngineTransport()) as http:
                with pytest.raises(EngineBadResponse, match="reads back as 'default'"):
                    await VLLMClient(http, URL).update_weights("/ckpt", 2)

    run(go())


def test_info_dev_mode():
    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeVLLM(router, URL, max_model_len=4096, root="/models/tiny", served="tiny")
            fake.weight_version = "3"
            async with httpx.AsyncClient(transport=EngineTransport()) as http:
                return await VLLMClient(http, URL).info()

    info = run(go())
    assert info.context_length == 4096 and info.model_path == "/models/tiny" and info.served_model == "tiny"
    assert info.weight_version == 3 and info.can_pause and info.can_reload
    assert info.tied_lm_head is False and info.warnings == ()


def test_info_without_dev_mode_warns():
    async def go():
        with respx.mock(assert_all_called=False) as router:
            FakeVLLM(router, URL, dev_mode=False, root="/nonexistent/tiny")
            async with httpx.AsyncClient(transport=EngineTransport()) as http:
                return await VLLMClient(http, URL).info()

    info = run(go())
    assert info.context_length == 4096 and not info.can_pause and not info.can_reload
    assert info.weight_version is None and info.tied_lm_head is None
    assert len(info.warnings) == 1 and "VLLM_SERVER_DEV_MODE=1" in info.warnings[0]
    assert "/pause" in info.warnings[0] and "/collective_rpc" in info.warnings[0]


def test_info_tied_head_from_the_engine_or_the_local_config(tmp_path):
    (tmp_path / "config.json").write_text('{"tie_word_embeddings": true, "model_type": "qwen3"}')

    async def go():
        with respx.mock(assert_all_called=False) as router:
            FakeVLLM(router, URL, tied=True)
            # vLLM 0.32's /server_info has no hf_config: the model dir's config.json decides
            FakeVLLM(router, "http://vllm-b:8000", tied=None, root=str(tmp_path))
            async with httpx.AsyncClient(transport=EngineTransport()) as http:
                return await VLLMClient(http, URL).info(), await VLLMClient(http, "http://vllm-b:8000").info()

    a, b = run(go())
    assert a.tied_lm_head is True and b.tied_lm_head is True
    assert any("tie_word_embeddings" in w for w in a.warnings)
