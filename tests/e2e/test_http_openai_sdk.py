"""The real ``openai`` SDK against ``splice serve`` (reference engine in script mode).

Every request gets the same scripted assistant turn (reasoning, a sentence, one tool call), so
the tests do not depend on the order they run in: the script has a single entry.
"""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

from tests.e2e.conftest import kill_tree, start_proxy

pytestmark = pytest.mark.slow

REASONING = "I should call the adder."
TEXT = "Let me add those numbers."
ENTRY = f'<think>\n{REASONING}\n</think>\n\n{TEXT}\n<tool_call>\n{{"name": "add", "arguments": {{"a": 2, "b": 3}}}}\n</tool_call><|im_end|>'

RESPONSES_TOOLS = [
    {
        "type": "function",
        "name": "add",
        "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]},
    }
]
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]},
        },
    }
]


@pytest.fixture(scope="module")
def proxy(tmp_path_factory, model_dir):
    # 5 ms a token: the reasoning and text span ~80 ms, so streamed deltas do not all land in one
    # engine frame even when a loaded machine stalls the engine's event loop for a while
    p = start_proxy(tmp_path_factory.mktemp("sdk"), model_dir, script=[ENTRY], delay_ms=5)
    yield p
    kill_tree(p)


def _client(proxy, session_id: str | None = None):
    from openai import OpenAI

    headers = {"X-Session-Id": session_id} if session_id else {}
    return OpenAI(base_url=proxy.url + "/v1", api_key="unused", default_headers=headers, max_retries=0, timeout=60)


def _sid() -> str:
    return "sdk-" + uuid.uuid4().hex[:10]


def _session(proxy, sid: str) -> dict:
    r = proxy.get(f"/v1/sessions/{sid}")
    assert r.status_code == 200, r.text
    return r.json()


def _check_function_call(items, *, args=None):
    calls = [it for it in items if it.type == "function_call"]
    assert len(calls) == 1, items
    call = calls[0]
    assert call.name == "add"
    assert json.loads(call.arguments) == (args or {"a": 2, "b": 3})
    assert call.call_id
    return call


def test_responses_non_streaming(proxy):
    sid = _sid()
    client = _client(proxy, sid)
    r = client.responses.create(model="splice-model", input="Add 2 and 3.", tools=RESPONSES_TOOLS)
    assert r.status == "completed"
    assert r.id.startswith("resp_")
    assert r.output_text == TEXT
    types = [it.type for it in r.output]
    assert types == ["reasoning", "message", "function_call"], types
    _check_function_call(r.output)
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    s = _session(proxy, sid)
    assert len(s["turns"]) == 1
    t = s["turns"][0]
    assert len(t["output_ids"]) == r.usage.output_tokens
    assert t["output_ids"][-1] == 151645  # <|im_end|> sampled, kept verbatim
    assert r.model_extra["splice"]["session_id"] == sid


def test_responses_streaming_events(proxy):
    sid = _sid()
    client = _client(proxy, sid)
    stream = client.responses.create(model="splice-model", input="Add 2 and 3.", tools=RESPONSES_TOOLS, stream=True)
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[1] == "response.in_progress"
    assert kinds[-1] == "response.completed"
    for k in ("response.output_item.added", "response.content_part.added", "response.output_text.delta",
              "response.output_text.done", "response.output_item.done", "response.function_call_arguments.done"):
        assert k in kinds, (k, kinds)
    # streamed as the engine produces tokens: a proxy that waited for the whole turn would send
    # exactly one reasoning delta and one text delta
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    thoughts = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert deltas and thoughts and len(deltas) + len(thoughts) > 2, (thoughts, deltas)
    assert "".join(deltas) == TEXT
    seqs = [e.sequence_number for e in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    final = events[-1].response
    assert final.status == "completed" and final.output_text == TEXT
    call = _check_function_call(final.output)
    assert final.usage.output_tokens == len(_session(proxy, sid)["turns"][0]["output_ids"])
    # a streamed response is stored like any other, and continuing it (streamed) is spliced
    got = client.responses.retrieve(final.id)
    assert got.output_text == TEXT and [it.type for it in got.output] == [it.type for it in final.output]
    stream2 = client.responses.create(
        model="splice-model",
        previous_response_id=final.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "5"}],
        tools=RESPONSES_TOOLS,
        stream=True,
    )
    last = list(stream2)[-1]
    assert last.type == "response.completed" and last.response.previous_response_id == final.id
    t1, t2 = _session(proxy, sid)["turns"]
    assert t2["spliced"], t2["fork_reason"]
    assert t2["prompt_ids"][: len(t1["prompt_ids"]) + len(t1["output_ids"])] == t1["prompt_ids"] + t1["output_ids"]


def test_responses_stream_helper_final_response(proxy):
    client = _client(proxy, _sid())
    texts = []
    with client.responses.stream(model="splice-model", input="Add 2 and 3.", tools=RESPONSES_TOOLS) as stream:
        for ev in stream:
            if ev.type == "response.output_text.delta":
                texts.append(ev.delta)
        final = stream.get_final_response()
    assert "".join(texts) == TEXT
    assert final.status == "completed"
    assert final.output_text == TEXT
    _check_function_call(final.output)


def test_previous_response_id_is_spliced_and_stored(proxy):
    client = _client(proxy)  # no session header: the session is found from previous_response_id
    r1 = client.responses.create(model="splice-model", input="Add 2 and 3.", tools=RESPONSES_TOOLS)
    call = _check_function_call(r1.output)
    sid = r1.model_extra["splice"]["session_id"]
    r2 = client.responses.create(
        model="splice-model",
        previous_response_id=r1.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "5"}],
        tools=RESPONSES_TOOLS,
    )
    assert r2.status == "completed"
    assert r2.previous_response_id == r1.id
    assert r2.model_extra["splice"]["session_id"] == sid
    s = _session(proxy, sid)
    t1, t2 = s["turns"]
    assert t2["spliced"] is True and t2["fork_reason"] is None
    full1 = t1["prompt_ids"] + t1["output_ids"]
    assert t2["prompt_ids"][: len(full1)] == full1
    assert len(t2["prompt_ids"]) > len(full1)  # the bridge: tool result + generation prompt
    assert s["spliced_turns"] == 1

    # stored responses: GET returns what POST returned
    for resp in (r1, r2):
        got = client.responses.retrieve(resp.id)
        assert got.id == resp.id
        assert got.output_text == resp.output_text
        assert [it.type for it in got.output] == [it.type for it in resp.output]
        assert got.usage.output_tokens == resp.usage.output_tokens
    raw = httpx.get(f"{proxy.url}/v1/responses/{r2.id}", timeout=30).json()
    assert raw["previous_response_id"] == r1.id

    # a third turn continuing the second by previous_response_id is spliced onto it
    call2 = _check_function_call(r2.output)
    r3 = client.responses.create(
        model="splice-model",
        previous_response_id=r2.id,
        input=[{"type": "function_call_output", "call_id": call2.call_id, "output": "5"}],
        tools=RESPONSES_TOOLS,
    )
    s = _session(proxy, sid)
    assert len(s["turns"]) == 3 and s["turns"][2]["spliced"]
    t2, t3 = s["turns"][1], s["turns"][2]
    assert t3["prompt_ids"][: len(t2["prompt_ids"]) + len(t2["output_ids"])] == t2["prompt_ids"] + t2["output_ids"]
    assert r3.status == "completed"


def test_chat_non_streaming_with_tools(proxy):
    sid = _sid()
    client = _client(proxy, sid)
    msgs = [{"role": "user", "content": "Add 2 and 3."}]
    c = client.chat.completions.create(model="splice-model", messages=msgs, tools=CHAT_TOOLS)
    choice = c.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == TEXT
    assert choice.message.model_extra.get("reasoning_content") == REASONING
    (tc,) = choice.message.tool_calls
    assert tc.type == "function" and tc.function.name == "add"
    assert json.loads(tc.function.arguments) == {"a": 2, "b": 3}
    assert c.usage.completion_tokens == len(_session(proxy, sid)["turns"][0]["output_ids"])

    # the next turn replays the assistant message as a Chat client does (no reasoning) + tool result
    msgs += [
        {"role": "assistant", "content": choice.message.content, "tool_calls": [tc.model_dump()]},
        {"role": "tool", "tool_call_id": tc.id, "content": "5"},
    ]
    c2 = client.chat.completions.create(model="splice-model", messages=msgs, tools=CHAT_TOOLS)
    assert c2.choices[0].finish_reason == "tool_calls"
    t1, t2 = _session(proxy, sid)["turns"]
    assert t2["spliced"], t2["fork_reason"]
    assert t2["prompt_ids"][: len(t1["prompt_ids"]) + len(t1["output_ids"])] == t1["prompt_ids"] + t1["output_ids"]


def test_chat_streaming_with_tools_and_usage(proxy):
    sid = _sid()
    client = _client(proxy, sid)
    stream = client.chat.completions.create(
        model="splice-model",
        messages=[{"role": "user", "content": "Add 2 and 3."}],
        tools=CHAT_TOOLS,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks, "no chunks"
    ids = {ch.id for ch in chunks}
    assert len(ids) == 1
    content, reasoning, calls, finish = [], [], {}, []
    usage_chunks = [ch for ch in chunks if ch.usage is not None]
    for ch in chunks:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        if d.content:
            content.append(d.content)
        r = (d.model_extra or {}).get("reasoning_content")
        if r:
            reasoning.append(r)
        for tc in d.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            if tc.id:
                slot["id"] = tc.id
            if tc.function and tc.function.name:
                slot["name"] += tc.function.name
            if tc.function and tc.function.arguments:
                slot["arguments"] += tc.function.arguments
        if ch.choices[0].finish_reason:
            finish.append(ch.choices[0].finish_reason)
    assert "".join(content) == TEXT
    assert "".join(reasoning) == REASONING
    assert list(calls) == [0]
    assert calls[0]["name"] == "add" and calls[0]["id"]
    assert json.loads(calls[0]["arguments"]) == {"a": 2, "b": 3}
    assert finish == ["tool_calls"]
    # the usage chunk is the last one, with empty choices
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1] and chunks[-1].choices == []
    u = usage_chunks[0].usage
    turn = _session(proxy, sid)["turns"][0]
    assert u.completion_tokens == len(turn["output_ids"])
    assert u.prompt_tokens == len(turn["prompt_ids"])
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens

    # continue from the reassembled stream, as a Chat client does: the next turn is spliced
    msgs = [
        {"role": "user", "content": "Add 2 and 3."},
        {"role": "assistant", "content": "".join(content), "tool_calls": [{"id": calls[0]["id"], "type": "function", "function": {"name": "add", "arguments": calls[0]["arguments"]}}]},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "5"},
    ]
    client.chat.completions.create(model="splice-model", messages=msgs, tools=CHAT_TOOLS)
    t1, t2 = _session(proxy, sid)["turns"]
    assert t2["spliced"], t2["fork_reason"]
    assert t2["prompt_ids"][: len(t1["prompt_ids"]) + len(t1["output_ids"])] == t1["prompt_ids"] + t1["output_ids"]


def test_models_and_health(proxy):
    client = _client(proxy)
    assert [m.id for m in client.models.list().data] == ["splice-model"]
    assert proxy.get("/health").json()["status"] == "ok"
    metrics = proxy.get("/metrics")
    assert metrics.status_code == 200 and "# TYPE" in metrics.text


@pytest.mark.parametrize("cut", [{"stop": ["add those"]}, {"max_tokens": 12}])
def test_turn_cut_by_stop_string_or_length_is_closed_by_the_bridge(proxy, cut):
    """docs/design.md 3: the ids keep what was sampled (no end token here), and the next turn's bridge
    starts with the tokens that close the unfinished assistant turn."""
    sid = _sid()
    client = _client(proxy, sid)
    msgs = [{"role": "user", "content": "Add 2 and 3."}]
    c = client.chat.completions.create(model="splice-model", messages=msgs, tools=CHAT_TOOLS, **cut)
    choice = c.choices[0]
    assert choice.finish_reason == ("stop" if "stop" in cut else "length")
    assert not choice.message.tool_calls
    msgs += [{"role": "assistant", "content": choice.message.content}, {"role": "user", "content": "Go on."}]
    client.chat.completions.create(model="splice-model", messages=msgs, tools=CHAT_TOOLS)
    t1, t2 = _session(proxy, sid)["turns"]
    assert t2["spliced"], t2["fork_reason"]
    out = t1["output_ids"]
    assert 151645 not in out  # the turn was not closed by the model
    if "max_tokens" in cut:
        assert len(out) == cut["max_tokens"] and t1["finish_reason"] == "length"
    else:
        tok = __import__("transformers").AutoTokenizer.from_pretrained(_model_dir(proxy))
        assert tok.decode(out).endswith("add those")  # the stop string's tokens are kept
        assert "add those" not in choice.message.content  # but the text ends before it, as OpenAI's does
    full = t1["prompt_ids"] + out
    assert t2["prompt_ids"][: len(full)] == full
    assert t2["prompt_ids"][len(full)] == 151645  # <|im_end|> closes the cut turn


def _model_dir(proxy) -> str:
    return proxy.args[proxy.args.index("--reference-model") + 1]


def test_streamed_text_never_contains_the_stop_string(proxy):
    client = _client(proxy, _sid())
    msgs = [{"role": "user", "content": "Add 2 and 3."}]
    chunks = client.chat.completions.create(model="splice-model", messages=msgs, tools=CHAT_TOOLS, stop=["add those"], stream=True)
    text = "".join((c.choices[0].delta.content or "") for c in chunks if c.choices)
    assert text == "Let me "  # held back while it could be the stop string, dropped once it was
