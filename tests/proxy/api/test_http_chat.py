"""Chat Completions over real HTTP with the openai SDK."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion

from proxy.ids import turn_id_from

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
        },
    },
    {"type": "function", "function": {"name": "open_page", "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}}}},
]
TWO_CALLS = (
    "<think>\nTwo things to do — 検索 first.\n</think>\n\n"
    '<tool_call>\n{"name": "search", "arguments": {"q": "naïve café ☕"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "open_page", "arguments": {"n": 3}}\n</tool_call><|im_end|>'
)
PLAIN = "<think>\nEasy.\n</think>\n\nHello — nice to meet you! 👋<|im_end|>"


def test_nonstreaming_text(client, live):
    live.runner.script(PLAIN)
    r = client.chat.completions.create(model="m", messages=[{"role": "system", "content": "be nice"}, {"role": "user", "content": "hi"}])
    c = r.choices[0]
    assert c.finish_reason == "stop"
    assert c.message.content == "Hello — nice to meet you! 👋"
    assert c.message.model_extra["reasoning_content"] == "Easy."
    assert c.message.tool_calls is None
    assert r.object == "chat.completion" and turn_id_from(r.id)
    n = len(live.runner.results[-1].generation.output_ids)
    assert r.usage.completion_tokens == n and r.usage.prompt_tokens == 17 and r.usage.total_tokens == n + 17
    assert r.usage.prompt_tokens_details.cached_tokens == 5
    assert c.logprobs is None
    raw = httpx.post(f"{live.base_url}/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}]}).json()
    ChatCompletion.model_validate(raw)


def test_nonstreaming_tool_calls_and_logprobs(client, live):
    live.runner.script(TWO_CALLS)
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "look it up"}], tools=TOOLS, logprobs=True, top_logprobs=2)
    c = r.choices[0]
    tid = turn_id_from(r.id)
    assert c.finish_reason == "tool_calls"
    assert c.message.content is None
    assert [(t.id, t.function.name) for t in c.message.tool_calls] == [(f"call_{tid}_0", "search"), (f"call_{tid}_1", "open_page")]
    assert json.loads(c.message.tool_calls[0].function.arguments) == {"q": "naïve café ☕"}
    gen = live.runner.results[-1].generation
    lp = c.logprobs.content
    assert len(lp) == len(gen.output_ids)
    assert [x.logprob for x in lp] == pytest.approx(gen.logprobs)
    # token bytes concatenate to the exact UTF-8 of the output
    joined = b"".join(bytes(x.bytes) for x in lp)
    assert joined.decode("utf-8") == live.runner.tokenizer.decode(gen.output_ids)


def test_history_conversion_and_parent_hint(client, live):
    live.runner.script(TWO_CALLS, "Done.<|im_end|>")
    r1 = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "go"}], tools=TOOLS)
    calls = r1.choices[0].message.tool_calls
    msgs = [
        {"role": "developer", "content": [{"type": "text", "text": "dev note"}]},
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Two things",
            "tool_calls": [t.model_dump(exclude_none=True) for t in calls],
        },
        {"role": "tool", "tool_call_id": calls[0].id, "content": "results..."},
        {"role": "tool", "tool_call_id": calls[1].id, "content": [{"type": "text", "text": "page 3"}]},
    ]
    r2 = client.chat.completions.create(
        model="m", messages=msgs, tools=TOOLS, max_completion_tokens=50, stop=["\n\n"],
        extra_headers={"X-Session-Id": "sess-9", "X-Group-Id": "g", "X-Group-Size": "4"},
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    assert r2.choices[0].message.content == "Done."
    req = live.runner.requests[-1]
    assert [m.role for m in req.messages] == ["developer", "user", "assistant", "tool", "tool"]
    a = req.messages[2]
    assert a.content == "" and a.reasoning == "Two things" and [t.name for t in a.tool_calls] == ["search", "open_page"]
    assert req.messages[3].name == "search" and req.messages[4].content == "page 3"
    assert req.parent_hint == turn_id_from(r1.id)
    assert (req.session_id, req.group_id, req.group_size) == ("sess-9", "g", 4)
    assert req.max_output_tokens == 50 and req.stop == ["\n\n"]
    assert req.chat_template_kwargs == {"enable_thinking": True}
    assert [t.name for t in req.tools] == ["search", "open_page"]


def test_length_finish_reason(client, live):
    live.runner.script("a b c d e f g h i j k<|im_end|>")
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=4)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4


def test_streaming_with_tools_and_usage(client, live):
    live.runner.script(TWO_CALLS)
    live.runner.chunk = 1
    chunks = list(
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], tools=TOOLS, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    ids = {c.id for c in chunks}
    assert len(ids) == 1
    tid = turn_id_from(ids.pop())
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks if c.choices)
    assert reasoning == "Two things to do — 検索 first."
    assert sum(1 for c in chunks if c.choices and (c.choices[0].delta.model_extra or {}).get("reasoning_content")) > 3
    # reassemble tool calls from deltas
    calls: dict[int, dict] = {}
    for c in chunks:
        if not c.choices:
            continue
        for d in c.choices[0].delta.tool_calls or []:
            slot = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            if d.id:
                slot["id"] = d.id
            if d.function and d.function.name:
                slot["name"] += d.function.name
            if d.function and d.function.arguments:
                slot["arguments"] += d.function.arguments
    assert [calls[k]["id"] for k in sorted(calls)] == [f"call_{tid}_0", f"call_{tid}_1"]
    assert [calls[k]["name"] for k in sorted(calls)] == ["search", "open_page"]
    assert json.loads(calls[0]["arguments"]) == {"q": "naïve café ☕"} and json.loads(calls[1]["arguments"]) == {"n": 3}
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "tool_calls"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(live.runner.results[-1].generation.output_ids)
    assert all(c.usage is None for c in chunks[:-1])
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == ""


def test_stream_helper_text(client, live):
    live.runner.script(PLAIN)
    live.runner.chunk = 2
    with client.chat.completions.stream(model="m", messages=[{"role": "user", "content": "hi"}]) as s:
        deltas = [e.delta for e in s if e.type == "content.delta"]
        final = s.get_final_completion()
    assert "".join(deltas) == final.choices[0].message.content == "Hello — nice to meet you! 👋"
    assert final.choices[0].finish_reason == "stop"


def test_streaming_without_usage_ends_with_done(live):
    live.runner.script("Hi!<|im_end|>")
    with httpx.stream("POST", f"{live.base_url}/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    bodies = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert all("usage" not in b for b in bodies)
    assert bodies[-1]["choices"][0]["finish_reason"] == "stop"


def test_streaming_error_midway(client, live):
    live.runner.script("one two three four five six<|im_end|>")
    live.runner.fail_after = 2
    live.runner.chunk = 1
    with pytest.raises(openai.APIError):
        list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], stream=True))


def test_bad_chat_inputs(live):
    url = f"{live.base_url}/v1/chat/completions"
    user = [{"role": "user", "content": "x"}]
    cases = [
        ({"model": "m", "messages": user, "n": 2}, "n"),
        ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]}, "messages[0].content[0]"),
        ({"model": "m", "messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"model": "m", "messages": user, "tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0]"),
        ({"model": "m", "messages": user, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m"}, "messages"),
        ({"model": "m", "messages": user, "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "messages": user, "stop": 5}, "stop"),
    ]
    for body, param in cases:
        r = httpx.post(url, json=body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param, (body, err)
    r = httpx.post(url, content=b"[1,2]", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    assert not live.runner.requests


def test_unknown_fields_are_ignored(client, live):
    r = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "x", "name": "bob"}], seed=3, user="u", metadata={"k": "v"},
        extra_body={"some_future_param": {"a": 1}, "top_k": 20},
    )
    assert r.choices[0].message.content == "OK."
