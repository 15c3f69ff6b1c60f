"""Responses API over real HTTP with the openai SDK."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.types.responses import Response

from proxy.ids import turn_id_from

THINK_CALL = (
    "<think>\nThe user wants the weather. 天气 ☀️ — I'll call the tool.\n</think>\n\n"
    "Let me check that for you.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}}\n</tool_call>'
    "<|im_end|>"
)
THINK_TEXT = "<think>\nSimple: 2+2.\n</think>\n\nThe answer is **4** ✅.<|im_end|>"
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}, "required": ["city"]},
        "strict": False,
    }
]


def _types(output):
    return [o.type for o in output]


def test_nonstreaming_text_with_reasoning(client, live):
    live.runner.script(THINK_TEXT)
    r = client.responses.create(model="m", input="What is 2+2?", instructions="Be brief.")
    assert r.object == "response" and r.status == "completed"
    assert _types(r.output) == ["reasoning", "message"]
    rs, msg = r.output
    tid = turn_id_from(r.id)
    assert tid and rs.id == f"rs_{tid}" and msg.id == f"msg_{tid}"
    assert rs.summary == [] and rs.content[0].type == "reasoning_text" and rs.content[0].text == "Simple: 2+2."
    assert r.output_text == "The answer is **4** ✅."
    assert msg.content[0].annotations == []
    n_out = len(live.runner.results[-1].generation.output_ids)
    assert r.usage.output_tokens == n_out and r.usage.input_tokens == 17
    assert r.usage.input_tokens_details.cached_tokens == 5
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < n_out
    assert r.usage.total_tokens == 17 + n_out
    # the session layer got one system + one user message
    req = live.runner.requests[-1]
    assert [(m.role, m.content) for m in req.messages] == [("system", "Be brief."), ("user", "What is 2+2?")]
    extra = r.model_extra or {}
    assert extra["splice"]["turn_id"] == tid and extra["splice"]["malformed_tool_calls"] == 0
    # the raw JSON validates strictly against the SDK's model
    raw = httpx.get(f"{live.base_url}/v1/responses/{r.id}").json()
    Response.model_validate(raw)


def test_nonstreaming_tool_call(client, live):
    live.runner.script(THINK_CALL)
    r = client.responses.create(model="m", input="Weather in Zürich?", tools=TOOLS)
    assert _types(r.output) == ["reasoning", "message", "function_call"]
    fc = r.output[2]
    tid = turn_id_from(r.id)
    assert fc.id == f"fc_{tid}_0" and fc.call_id == f"call_{tid}_0" and fc.name == "get_weather"
    assert json.loads(fc.arguments) == {"city": "Zürich", "unit": "c"}
    assert fc.status == "completed"
    assert r.output_text == "Let me check that for you."
    assert r.tools[0].name == "get_weather"
    assert live.runner.requests[-1].tools[0].name == "get_weather"


def test_length_limit_is_incomplete(client, live):
    live.runner.script("word " * 50 + "<|im_end|>")
    r = client.responses.create(model="m", input="talk", max_output_tokens=8)
    assert r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete"
    assert r.usage.output_tokens == 8


def test_get_and_previous_response_id(client, live):
    live.runner.script(THINK_CALL, "It is sunny in Zürich.<|im_end|>")
    r1 = client.responses.create(model="m", input="Weather in Zürich?", tools=TOOLS, instructions="sys A", metadata={"session_id": "s-1"})
    fc = r1.output[-1]
    got = client.responses.retrieve(r1.id)
    assert got.id == r1.id and got.output_text == r1.output_text
    r2 = client.responses.create(
        model="m",
        previous_response_id=r1.id,
        instructions="sys B",
        input=[{"type": "function_call_output", "call_id": fc.call_id, "output": "sunny, 21C"}],
        tools=TOOLS,
        metadata={"session_id": "s-1"},
    )
    assert r2.previous_response_id == r1.id
    req = live.runner.requests[-1]
    roles = [m.role for m in req.messages]
    assert roles == ["system", "user", "assistant", "tool"]
    assert req.messages[0].content == "sys B"  # instructions are not carried over
    asst = req.messages[2]
    assert asst.reasoning.startswith("The user wants") and asst.content == "Let me check that for you."
    assert asst.tool_calls[0].id == fc.call_id and json.loads(asst.tool_calls[0].arguments)["city"] == "Zürich"
    assert req.messages[3].tool_call_id == fc.call_id and req.messages[3].name == "get_weather"
    assert req.parent_hint == turn_id_from(r1.id)
    assert req.session_id == "s-1"
    # chaining further keeps the whole history
    r3 = client.responses.create(model="m", previous_response_id=r2.id, input="thanks")
    assert [m.role for m in live.runner.requests[-1].messages] == ["user", "assistant", "tool", "assistant", "user"]
    assert r3.status == "completed"


def test_unknown_ids_are_404(client, live):
    with pytest.raises(openai.NotFoundError) as ei:
        client.responses.create(model="m", previous_response_id="resp_" + "0" * 24, input="x")
    assert ei.value.body["code"] == "previous_response_not_found"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nope")
    r = httpx.get(f"{live.base_url}/v1/responses/resp_nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_store_false_is_not_retrievable(client, live):
    r = client.responses.create(model="m", input="hi", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_bad_inputs_are_400_in_openai_shape(live):
    cases = [
        ({"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input[0].content[0]"),
        ({"model": "m", "input": "x", "tools": [{"type": "rocket_launcher"}]}, "tools[0]"),
        ({"model": "m", "input": [{"type": "computer_call", "id": "c"}]}, "input[0]"),
        ({"model": "m", "input": "x", "temperature": 7}, "temperature"),
        ({"model": "m", "input": "x", "background": True}, "background"),
        ({"model": "m"}, "input"),
    ]
    for body, param in cases:
        r = httpx.post(f"{live.base_url}/v1/responses", json=body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param, err
        assert param.split("[")[0] in err["message"]
    r = httpx.post(f"{live.base_url}/v1/responses", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    assert not live.runner.requests


def test_runner_errors_map_to_status(client, live):
    from proxy.errors import APIError

    live.runner.script(APIError(400, "prompt too long", code="context_length_exceeded"))
    with pytest.raises(openai.BadRequestError) as ei:
        client.responses.create(model="m", input="x")
    assert ei.value.body["code"] == "context_length_exceeded"
    # the same before the first token of a stream: a plain HTTP error, not a stream
    live.runner.script(APIError(400, "prompt too long", code="context_length_exceeded"))
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="m", input="x", stream=True)


# ------------------------------------------------------------------------------ streaming


def _collect(stream):
    return [e for e in stream]


def test_streaming_event_sequence(client, live):
    live.runner.script(THINK_CALL)
    events = _collect(client.responses.create(model="m", input="Weather?", tools=TOOLS, stream=True))
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[1] == "response.in_progress"
    assert types[-1] == "response.completed"
    seqs = [e.sequence_number for e in events]
    assert seqs == list(range(len(events)))
    final = events[-1].response
    assert _types(final.output) == ["reasoning", "message", "function_call"]
    tid = turn_id_from(final.id)
    assert events[0].response.id == final.id and events[0].response.status == "in_progress"
    # items: added/done ids match the final output, in order
    added = [e for e in events if e.type == "response.output_item.added"]
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [e.item.id for e in added] == [e.item.id for e in done] == [o.id for o in final.output]
    assert [e.output_index for e in added] == [0, 1, 2]
    assert final.output[2].call_id == f"call_{tid}_0"
    # reasoning deltas add up to the final reasoning text; text deltas to the final text
    rdeltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert rdeltas == final.output[0].content[0].text
    tdeltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert tdeltas == final.output_text == "Let me check that for you."
    assert len([e for e in events if e.type == "response.output_text.delta"]) > 2  # really streamed
    tdone = next(e for e in events if e.type == "response.output_text.done")
    assert tdone.text == tdeltas and tdone.item_id == f"msg_{tid}"
    adelta = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    adone = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert adelta == adone.arguments == final.output[2].arguments
    # event order per item
    i = types.index
    assert i("response.output_item.added") < i("response.content_part.added") < i("response.reasoning_text.delta")
    assert i("response.reasoning_text.done") < i("response.output_text.delta") < i("response.output_text.done")
    assert i("response.content_part.done") < i("response.function_call_arguments.delta")
    assert final.usage.output_tokens == len(live.runner.results[-1].generation.output_ids)
    # the streamed response was stored
    assert client.responses.retrieve(final.id).output[2].call_id == final.output[2].call_id


def test_stream_helper_get_final_response(client, live):
    live.runner.script(THINK_TEXT)
    live.runner.chunk = 1
    with client.responses.stream(model="m", input="2+2?") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.output_text == "".join(deltas) == "The answer is **4** ✅."
    assert final.status == "completed"


@pytest.mark.anyio
async def test_async_stream_helper_with_tools(aclient, live):
    live.runner.script(THINK_CALL)
    async with aclient.responses.stream(model="m", input="weather", tools=TOOLS) as stream:
        async for _ in stream:
            pass
        final = await stream.get_final_response()
    assert _types(final.output) == ["reasoning", "message", "function_call"]
    assert json.loads(final.output[2].arguments)["city"] == "Zürich"


def test_streaming_incomplete(client, live):
    live.runner.script("word " * 40 + "<|im_end|>")
    events = _collect(client.responses.create(model="m", input="talk", stream=True, max_output_tokens=6))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text


def test_streaming_malformed_call_is_text(client, live):
    live.runner.script('Trying.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call><|im_end|>')
    events = _collect(client.responses.create(model="m", input="w", tools=TOOLS, stream=True))
    final = events[-1].response
    assert _types(final.output) == ["message"]
    assert final.output_text.startswith("Trying.\n<tool_call>")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text
    assert final.model_extra["splice"]["malformed_tool_calls"] == 1


def test_streaming_failure_midway(client, live):
    live.runner.script("one two three four five six seven eight nine ten<|im_end|>")
    live.runner.fail_after = 3
    live.runner.chunk = 1
    events = _collect(client.responses.create(model="m", input="x", stream=True))
    assert events[-1].type == "response.failed"
    assert events[-1].response.error.message
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_empty_output_has_an_empty_message(client, live):
    live.runner.script("<|im_end|>")
    r = client.responses.create(model="m", input="x")
    assert _types(r.output) == ["message"] and r.output_text == ""
    events = _collect(client.responses.create(model="m", input="x", stream=True))
    assert _types(events[-1].response.output) == ["message"]


def test_client_disconnect_cancels_the_turn(live):
    import time as _time

    live.runner.script("word " * 400 + "<|im_end|>")
    live.runner.chunk = 1
    live.runner.delay = 0.01
    with httpx.stream("POST", f"{live.base_url}/v1/responses", json={"model": "m", "input": "x", "stream": True}) as r:
        it = r.iter_lines()
        seen = 0
        for line in it:
            if line.startswith("data:"):
                seen += 1
            if seen >= 5:
                break
    deadline = _time.time() + 5
    while not live.runner.cancelled and _time.time() < deadline:
        _time.sleep(0.02)
    assert live.runner.cancelled == 1
    assert not live.runner.results


@pytest.mark.anyio
async def test_agents_sdk_run_streamed_and_chat_model(aclient, live):
    from agents import Agent, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)

    @function_tool
    def get_weather(city: str, unit: str = "c") -> str:
        """Weather for a city."""
        return f"sunny in {city}"

    for model in (OpenAIResponsesModel("m", aclient), OpenAIChatCompletionsModel("m", aclient)):
        live.runner.reset()
        live.runner.script(THINK_CALL, "<think>\nok\n</think>\n\nSunny in Zürich.<|im_end|>")
        agent = Agent(name="a", instructions="help", tools=[get_weather], model=model)
        run = Runner.run_streamed(agent, "Weather in Zürich?")
        raw = [ev.data.type async for ev in run.stream_events() if ev.type == "raw_response_event"]
        assert run.final_output == "Sunny in Zürich."
        assert raw
        second = live.runner.requests[-1]
        assert [m.role for m in second.messages] == ["system", "user", "assistant", "tool"]
        assert second.messages[3].content == "sunny in Zürich"
        assert second.parent_hint == live.runner.results[0].turn_id
