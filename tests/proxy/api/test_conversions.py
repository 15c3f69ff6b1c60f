"""Pure conversions: Responses items / Chat messages -> Splice messages, ids, validation."""

from __future__ import annotations


import pytest

from proxy.api.chat import messages_to_conversation
from proxy.errors import APIError
from proxy.ids import (
    call_id,
    chat_completion_id,
    function_call_item_id,
    message_id,
    new_turn_id,
    reasoning_id,
    response_id,
    turn_id_from,
)
from proxy.api.content import convert_tools
from proxy.api.context import parent_hint, session_fields
from proxy.api.responses import build_context, input_to_messages, messages_from_json, messages_to_json
from tokenization.conversation import Message, ToolCall



def test_ids_roundtrip():
    t = new_turn_id()
    assert len(t) == 24 and t == t.lower() and int(t, 16) >= 0
    for made in (response_id(t), message_id(t), reasoning_id(t), function_call_item_id(t, 3), call_id(t, 12), chat_completion_id(t), t):
        assert turn_id_from(made) == t, made
    for other in (None, "", "resp_abc", "call_abc", "msg_" + "g" * 24, "call_" + t, "fc_" + t, "resp_" + t + "x", "toolu_01", "resp_" + t.upper()):
        assert turn_id_from(other) is None, other
    assert new_turn_id() != new_turn_id()


def test_header_values_pass_printable_ascii_and_encode_the_rest():
    from urllib.parse import unquote

    from proxy.ids import header_value

    assert header_value("sess a/b~%x") == "sess a/b~%x"
    for odd in ("tab\there", "del\x7f", "caf\u00e9", "\u4f1a\u8bdd", "nbsp\u00a0"):
        got = header_value(odd)
        assert got != odd and got.isascii() and got.isprintable() and unquote(got) == odd, got


def test_turn_and_session_ids_sort_by_time_and_stay_unguessable():
    """Later ids sort later (the store's indexes grow at their end); 56 bits stay random."""
    import time

    from proxy.session.planner import new_session_id

    made = []
    for _ in range(3):
        made.append((new_turn_id(), new_session_id()))
        time.sleep(0.002)
    turns, sessions = [t for t, _ in made], [s for _, s in made]
    assert turns == sorted(turns) and len(set(turns)) == 3
    assert sessions == sorted(sessions) and all(s.startswith("sess_") and len(s) == 29 for s in sessions)
    now_ms = time.time_ns() // 1_000_000 & (2**40 - 1)
    assert abs(int(turns[-1][:10], 16) - now_ms) < 5_000  # the head is the clock, in milliseconds
    same_ms = {new_turn_id()[10:] for _ in range(64)}  # the tail is random, even within a millisecond
    assert len(same_ms) == 64


def test_items_merge_into_one_assistant_message():
    t = new_turn_id()
    items = [
        {"role": "user", "content": "weather?"},
        {"type": "reasoning", "id": reasoning_id(t), "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "message", "id": message_id(t), "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "id": function_call_item_id(t, 0), "call_id": call_id(t, 0), "name": "a", "arguments": '{"x": 1}'},
        {"type": "function_call", "id": function_call_item_id(t, 1), "call_id": call_id(t, 1), "name": "b", "arguments": "{}"},
        {"type": "function_call_output", "call_id": call_id(t, 0), "output": "A"},
        {"type": "function_call_output", "call_id": call_id(t, 1), "output": [{"type": "input_text", "text": "B"}]},
    ]
    msgs, ids = input_to_messages(items)
    assert [m.role for m in msgs] == ["user", "assistant", "tool", "tool"]
    a = msgs[1]
    assert a.reasoning == "think" and a.content == "Checking."
    assert a.tool_calls == (ToolCall(call_id(t, 0), "a", '{"x": 1}'), ToolCall(call_id(t, 1), "b", "{}"))
    assert msgs[2] == Message(role="tool", content="A", tool_call_id=call_id(t, 0))
    assert msgs[3].content == "B"
    assert parent_hint(ids) == t


def test_items_that_start_new_assistant_turns():
    items = [
        {"type": "function_call", "call_id": "c1", "name": "a", "arguments": "{}"},
        {"type": "reasoning", "id": "rs_other", "summary": [{"type": "summary_text", "text": "s1"}]},
        {"role": "assistant", "content": "first"},
        {"role": "assistant", "content": "second"},
        {"type": "reasoning", "summary": [], "encrypted_content": "gAAA"},
        {"type": "function_call", "call_id": "c2", "name": "b", "arguments": "{}"},
        {"role": "user", "content": [{"type": "input_text", "text": "p1"}, {"type": "input_text", "text": "p2"}]},
    ]
    msgs, ids = input_to_messages(items)
    assert [(m.role, m.content, m.reasoning, [c.id for c in m.tool_calls]) for m in msgs] == [
        ("assistant", "", None, ["c1"]),
        ("assistant", "first", "s1", []),
        ("assistant", "second", None, []),
        ("assistant", "", None, ["c2"]),
        ("user", "p1\np2", None, []),
    ]
    assert parent_hint(ids) is None
    assert input_to_messages("hello")[0] == [Message(role="user", content="hello")]


@pytest.mark.parametrize(
    "items,param",
    [
        ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], "input[0].content[0]"),
        ([{"role": "user", "content": "ok"}, {"type": "input_file", "file_id": "f"}], "input[1]"),
        ([{"type": "web_search_call", "id": "ws"}], "input[0]"),
        ([{"role": "robot", "content": "x"}], "input[0].role"),
        ([{"type": "function_call", "name": "a", "arguments": "{}"}], "input[0].call_id"),
        ([{"type": "function_call_output", "call_id": "c"}], "input[0].output"),
        ([{"role": "user"}], "input[0].content"),
        (["just a string"], "input[0]"),
    ],
)
def test_bad_items_are_400(items, param):
    with pytest.raises(APIError) as ei:
        input_to_messages(items)
    e = ei.value
    assert e.status == 400 and e.param == param
    assert e.body()["error"]["type"] == "invalid_request_error"
    assert e.body()["error"]["message"]


def test_tools():
    tools, echo = convert_tools(
        [
            {"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}, "strict": False},
            {"type": "function", "function": {"name": "g"}},
        ]
    )
    assert [(t.name, t.description, t.parameters) for t in tools] == [("f", "d", {"type": "object"}), ("g", "", {})]
    assert echo[0]["strict"] is False and echo[1]["strict"] is True
    for bad, param in (
        ([{"type": "rocket_launcher"}], "tools[0]"),
        ([{"type": "function"}], "tools[0].name"),
        ([{"type": "function", "name": "f"}, {"type": "function", "name": "f"}], "tools[1].name"),
        ([{"type": "function", "name": "f", "parameters": "nope"}], "tools[0].parameters"),
    ):
        with pytest.raises(APIError) as ei:
            convert_tools(bad)
        assert ei.value.status == 400 and ei.value.param == param


def test_conversation_json_roundtrip():
    msgs = [
        Message(role="system", content="s"),
        Message(role="assistant", content="", reasoning="r", tool_calls=(ToolCall("call_1", "f", '{"a": "é"}'),)),
        Message(role="tool", content="out", tool_call_id="call_1", name="f"),
    ]
    assert messages_from_json(messages_to_json(msgs)) == msgs


def _ctx(body, store, headers=None):
    class R:
        model_name = "default-model"
        fmt = None

    return build_context(body, headers or {}, R(), store)


def test_previous_response_id_expansion(mem_store):
    store = mem_store
    t = new_turn_id()
    prev = [
        Message(role="user", content="q1"),
        Message(role="assistant", content="", reasoning="hm", tool_calls=(ToolCall(call_id(t, 0), "f", "{}"),)),
    ]
    store.put(response_id(t), "s", t, b'{"id": "x", "output": []}', messages_to_json(prev))
    ctx = _ctx(
        {"model": "m", "previous_response_id": response_id(t), "instructions": "new sys",
         "input": [{"type": "function_call_output", "call_id": call_id(t, 0), "output": "42"}]},
        store,
    )
    msgs = ctx.turn.messages
    assert [m.role for m in msgs] == ["system", "user", "assistant", "tool"]
    assert msgs[0].content == "new sys" and msgs[1:3] == prev
    assert msgs[3].name == "f" and msgs[3].tool_call_id == call_id(t, 0)
    assert ctx.history == msgs[1:]  # what gets stored excludes the instructions
    assert ctx.turn.parent_hint == t
    assert ctx.turn.model == "m"


def test_unknown_previous_response_is_404(mem_store):
    with pytest.raises(APIError) as ei:
        _ctx({"model": "m", "previous_response_id": "resp_" + "1" * 24, "input": "x"}, mem_store)
    e = ei.value
    assert e.status == 404 and e.code == "previous_response_not_found"
    assert e.body()["error"]["type"] == "not_found_error" and "resp_" + "1" * 24 in e.message


def test_item_reference_resolves_from_store(mem_store):
    store = mem_store
    t = new_turn_id()
    import orjson

    body = {"id": response_id(t), "output": [{"type": "function_call", "id": function_call_item_id(t, 0), "call_id": call_id(t, 0), "name": "f", "arguments": "{}"}]}
    store.put(response_id(t), "s", t, orjson.dumps(body), b"[]")
    ctx = _ctx({"input": [{"role": "user", "content": "x"}, {"type": "item_reference", "id": function_call_item_id(t, 0)}]}, store)
    assert ctx.turn.messages[-1].tool_calls[0].id == call_id(t, 0)
    assert ctx.turn.model == "default-model"
    with pytest.raises(APIError) as ei:
        _ctx({"input": [{"type": "item_reference", "id": "msg_unknown"}]}, store)
    assert ei.value.status == 404


def test_session_fields():
    assert session_fields({"x-session-id": "h"}, {"session_id": "m"}) == ("h", None, None)
    assert session_fields({}, {"session_id": "m", "group_id": "g", "group_size": "8"}) == ("m", "g", 8)
    for bad in ("zero", "0", "-2"):
        with pytest.raises(APIError):
            session_fields({"x-group-size": bad}, None)


def test_chat_messages():
    msgs, ids = messages_to_conversation(
        [
            {"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "x"}], "reasoning": "r",
             "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": {"k": 1}}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "res"},
            {"role": "assistant", "content": None, "reasoning_content": "rc"},
        ]
    )
    assert [m.role for m in msgs] == ["system", "user", "assistant", "tool", "assistant"]
    assert msgs[1].content == "a\nb"
    assert msgs[2].reasoning == "r" and msgs[2].tool_calls[0].arguments == '{"k":1}'
    assert msgs[3].name == "f" and msgs[4].content == "" and msgs[4].reasoning == "rc"
    assert ids == ["call_1", "call_1"]
    with pytest.raises(APIError) as ei:
        messages_to_conversation([{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}])
    assert ei.value.param == "messages[0].tool_calls[0].id"
