"""The Anthropic Messages API over real HTTP with the official ``anthropic`` SDK (scripted runner)."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from proxy.ids import turn_id_from
from tests.proxy.api.agents_server import serve

THINK_CALL = (
    "<think>\nThe user wants the weather in Zürich.\n</think>\n\n"
    "Checking.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call><|im_end|>'
)
THINK_TEXT = "<think>\nEasy one.\n</think>\n\nIt is sunny ☀️ in Zürich.<|im_end|>"
TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather for a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        "cache_control": {"type": "ephemeral"},
    }
]


@pytest.fixture(scope="module")
def mserver(tok, renderer):
    with serve(tok, renderer) as h:
        yield h


@pytest.fixture
def live(mserver):
    mserver.runner.reset()
    return mserver


@pytest.fixture
def client(live):
    c = anthropic.Anthropic(base_url=live.base_url, api_key="test", max_retries=0, timeout=30)
    yield c
    c.close()


def test_tool_loop_with_thinking(client, live):
    live.runner.script(THINK_CALL, THINK_TEXT)
    system = [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}]
    first = [{"role": "user", "content": "Weather in Zürich?"}]
    m1 = client.messages.create(model="claude-x", max_tokens=256, system=system, messages=first, tools=TOOLS)
    tid = turn_id_from(m1.id)
    assert tid and m1.type == "message" and m1.role == "assistant" and m1.stop_reason == "tool_use"
    assert [b.type for b in m1.content] == ["thinking", "text", "tool_use"]
    think, text, call = m1.content
    assert think.thinking == "The user wants the weather in Zürich." and think.signature == tid
    assert text.text == "Checking."
    assert call.id == f"toolu_{tid}_0" and turn_id_from(call.id) == tid
    assert call.name == "get_weather" and call.input == {"city": "Zürich"}
    n_out = len(live.runner.results[-1].generation.output_ids)
    assert m1.usage.output_tokens == n_out and m1.usage.input_tokens == 12 and m1.usage.cache_read_input_tokens == 5
    req1 = live.runner.requests[-1]
    assert req1.api == "messages" and req1.max_output_tokens == 256
    assert [(m.role, m.content) for m in req1.messages] == [("system", "You are terse."), ("user", "Weather in Zürich?")]
    assert [t.name for t in req1.tools] == ["get_weather"] and req1.tools[0].parameters["required"] == ["city"]

    # the client replays the whole assistant message and answers the call (block content, is_error)
    history = first + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m1.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "sunny"}], "is_error": False},
                {"type": "text", "text": "Thanks!"},
            ],
        },
    ]
    m2 = client.messages.create(model="claude-x", max_tokens=256, system=system, messages=history, tools=TOOLS)
    assert m2.stop_reason == "end_turn" and m2.content[-1].text == "It is sunny ☀️ in Zürich."
    req2 = live.runner.requests[-1]
    assert req2.parent_hint == tid  # the toolu_ id names the turn it continues
    roles = [m.role for m in req2.messages]
    assert roles == ["system", "user", "assistant", "tool", "user"]
    asst, tool_msg, user = req2.messages[2:]
    assert asst.reasoning == "The user wants the weather in Zürich." and asst.content == "Checking."
    assert asst.tool_calls[0].id == call.id and json.loads(asst.tool_calls[0].arguments) == {"city": "Zürich"}
    assert tool_msg.tool_call_id == call.id and tool_msg.content == "sunny" and tool_msg.name == "get_weather"
    assert user.content == "Thanks!"


def test_thinking_only_turn_is_named_by_its_signature(client, live):
    live.runner.script(THINK_TEXT, "OK.<|im_end|>")
    m1 = client.messages.create(model="m", max_tokens=64, messages=[{"role": "user", "content": "hi"}])
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m1.content]},
        {"role": "user", "content": "and tomorrow?"},
    ]
    client.messages.create(model="m", max_tokens=64, messages=history)
    assert live.runner.requests[-1].parent_hint == turn_id_from(m1.id)
    # redacted thinking is accepted (and carries nothing to render)
    history[1]["content"].insert(0, {"type": "redacted_thinking", "data": "opaque"})
    client.messages.create(model="m", max_tokens=64, messages=history)
    assert live.runner.requests[-1].messages[1].reasoning == "Easy one."


def test_streaming_event_grammar(client, live):
    live.runner.script(THINK_CALL)
    events = []
    with client.messages.stream(model="m", max_tokens=256, messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS) as s:
        for ev in s:
            events.append(ev)
        final = s.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert "thinking_delta" in deltas and "signature_delta" in deltas and "text_delta" in deltas and "input_json_delta" in deltas
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 3
    tid = live.runner.requests[-1].turn_id
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[0].thinking == "The user wants the weather in Zürich." and final.content[0].signature == tid
    assert final.content[1].text == "Checking."
    assert final.content[2].input == {"city": "Zürich"} and final.content[2].id == f"toolu_{tid}_0"
    assert final.stop_reason == "tool_use" and final.id == f"msg_{tid}"
    assert final.usage.output_tokens == len(live.runner.results[-1].generation.output_ids)
    # the raw stream: a ping after message_start, the splice block on message_delta
    live.runner.script(THINK_TEXT)
    with httpx.stream("POST", live.base_url + "/v1/messages", json={"model": "m", "max_tokens": 64, "stream": True,
                      "messages": [{"role": "user", "content": "x"}]}) as r:  # fmt: skip
        assert r.headers["x-splice-turn-id"]
        raw = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [d["type"] for d in raw[:2]] == ["message_start", "ping"]
    md = next(d for d in raw if d["type"] == "message_delta")
    assert md["delta"]["stop_reason"] == "end_turn" and md["splice"]["turn_id"] == r.headers["x-splice-turn-id"]
    text = "".join(d["delta"].get("text", "") for d in raw if d["type"] == "content_block_delta")
    assert text == "It is sunny ☀️ in Zürich."


def test_streaming_failure_is_an_error_event(live):
    live.runner.script("A long answer that will not finish because the engine fails.<|im_end|>")
    live.runner.fail_after = 3
    with httpx.stream("POST", live.base_url + "/v1/messages", json={"model": "m", "max_tokens": 64, "stream": True,
                      "messages": [{"role": "user", "content": "x"}]}) as r:  # fmt: skip
        raw = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert raw[-1]["type"] == "error" and raw[-1]["error"]["type"] == "api_error"


def test_max_tokens_and_stop_reason(client, live):
    live.runner.script("one two three four five six seven eight nine ten<|im_end|>")
    m = client.messages.create(model="m", max_tokens=3, messages=[{"role": "user", "content": "count"}])
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3


def test_count_tokens(client, live):
    msgs = [{"role": "user", "content": "How many tokens is this?"}]
    got = client.messages.count_tokens(model="m", system="Be brief.", messages=msgs, tools=TOOLS)
    from tokenization.conversation import Message, Tool

    fmt = live.runner.fmt
    want = fmt.render(
        [Message("system", "Be brief."), Message("user", "How many tokens is this?")],
        [Tool("get_weather", "Weather for a city", TOOLS[0]["input_schema"])],
    )
    assert got.input_tokens == len(want)
    assert live.runner.requests == []  # counting runs no turn


def test_error_shapes(client, live):
    cases = [
        ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        ({"model": "m", "max_tokens": 5, "messages": []}, "messages"),
        ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
        ({"model": "m", "max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]}, "role"),
        ({"model": "m", "max_tokens": 5, "temperature": 1.5, "messages": [{"role": "user", "content": "x"}]}, "temperature"),
        ({"model": "m", "max_tokens": 5, "tool_choice": {"type": "tool", "name": "nope"}, "messages": [{"role": "user", "content": "x"}]}, "nope"),
    ]
    for body, word in cases:
        r = httpx.post(live.base_url + "/v1/messages", json=body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error" and word in err["error"]["message"]
    r = httpx.post(live.base_url + "/v1/messages", content=b"{nope")
    assert r.status_code == 400 and r.json()["type"] == "error"
    with pytest.raises(anthropic.BadRequestError) as ei:
        client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}])
    assert ei.value.body["error"]["type"] == "invalid_request_error"
    # the session layer's failures keep their status in Anthropic's shape
    from proxy.errors import APIError

    live.runner.script(APIError(409, "session s already has a reward and is closed", code="session_closed"))
    with pytest.raises(anthropic.ConflictError):
        client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}])


def test_hosted_tools_and_controls_are_reported(client, live):
    live.runner.script("OK.<|im_end|>")
    tools = TOOLS + [{"type": "web_search_20250305", "name": "web_search", "max_uses": 3}, {"type": "bash_20250124", "name": "bash"}]
    m = client.messages.create(
        model="m", max_tokens=64, messages=[{"role": "user", "content": "x"}], tools=tools, extra_body={"top_k": 5, "temperature": 0.3},
        tool_choice={"type": "any", "disable_parallel_tool_use": True}, thinking={"type": "enabled", "budget_tokens": 2048},
        stop_sequences=["END"], cache_control={"type": "ephemeral"},
    )  # fmt: skip
    splice = m.model_extra["splice"]
    assert splice["tools_not_offered"] == ["bash_20250124", "web_search_20250305"]
    assert splice["controls_not_enforced"] == ["disable_parallel_tool_use", "thinking", "tool_choice", "top_k"]
    req = live.runner.requests[-1]
    assert [t.name for t in req.tools] == ["get_weather"]  # only what the model can call
    assert req.temperature == 0.3 and req.stop == ["END"]
    assert req.controls_not_enforced["thinking"] == {"type": "enabled", "budget_tokens": 2048}


def test_claude_code_session_identity(client, live):
    msgs = [{"role": "user", "content": "x"}]
    client.messages.create(model="m", max_tokens=8, messages=msgs, metadata={"user_id": json.dumps({"device_id": "d", "session_id": "cc-123"})})
    assert live.runner.requests[-1].session_id == "cc-123"
    client.messages.create(model="m", max_tokens=8, messages=msgs, metadata={"user_id": "user_abc_account__session_1b2c3d4e-0000-1111-2222-333344445555"})
    assert live.runner.requests[-1].session_id == "1b2c3d4e-0000-1111-2222-333344445555"
    client.messages.create(model="m", max_tokens=8, messages=msgs, extra_headers={"X-Claude-Code-Session-Id": "cc-hdr"})
    assert live.runner.requests[-1].session_id == "cc-hdr"
    # an explicit session wins
    client.messages.create(model="m", max_tokens=8, messages=msgs, extra_headers={"X-Claude-Code-Session-Id": "cc-hdr", "X-Session-Id": "ep-9"})
    assert live.runner.requests[-1].session_id == "ep-9"
    client.messages.create(model="m", max_tokens=8, messages=msgs)
    assert live.runner.requests[-1].session_id is None


def test_system_messages_inside_the_conversation(client, live):
    msgs = [
        {"role": "user", "content": [{"type": "text", "text": "<reminder>ctx</reminder>"}, {"type": "text", "text": "go"}]},
        {"role": "system", "content": [{"type": "text", "text": "# Environment"}]},
    ]
    client.messages.create(model="m", max_tokens=8, messages=msgs)
    got = [(m.role, m.content) for m in live.runner.requests[-1].messages]
    assert got == [("user", "<reminder>ctx</reminder>\ngo"), ("system", "# Environment")]
