"""A chat conversation's next request converts only the messages it adds (proxy/api/history_memo.py).

The reuse must be invisible: a long tool loop sends the engine exactly what the same loop sends
with the memo off, an edit anywhere in the history is seen (the edited text reaches the
engine), a deep value in an added message is still a 400, and values that compare equal but
convert differently (``1 == 1.0``) are never reused."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import httpx
import orjson
import pytest
import respx

from engines.pool import EnginePool
from proxy.api.chat import _message_converter, keepable
from proxy.api.history_memo import ITEM_BYTES, HistoryMemo, convert
from proxy.session.planner import message_chars
from proxy.app import create_app
from proxy.settings import Settings
from tests.fakes.engines import FakeSGLang, Step
from tokenization import ChatFormat, load_tokenizer, qwen3_tokenizer_dir

TOK = load_tokenizer(str(qwen3_tokenizer_dir()))
URL = "http://engine-a:30000"
TOOLS = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}]
TURNS = 14


def _step(k: int) -> Step:
    text = f'<tool_call>\n{{"name": "run", "arguments": {{"cmd": "step {k}"}}}}\n</tool_call><|im_end|>'
    return Step(tokens=[(t, -0.25 - i / 1024) for i, t in enumerate(TOK.encode(text, add_special_tokens=False))])


@asynccontextmanager
async def _serving(tmp_path, min_messages: int):
    """The real app (real Qwen3 tokenizer and template) before a scripted SGLang fake: (client, engine, app)."""
    with respx.mock(assert_all_called=False) as router:
        engine = FakeSGLang(router, URL, context_length=32_768)
        engine.script = [_step(k) for k in range(TURNS)]
        app = create_app(Settings(store=str(tmp_path / "s.sqlite"), engine_url=[URL]), fmt=ChatFormat(TOK, "qwen3"),
                         pool=EnginePool("sglang", [URL], health_interval_s=0))  # fmt: skip
        app.state.history_memo.min_messages = min_messages
        if min_messages < 10**9:  # every request parsed from the bytes it adds (resent_bytes.py), however short
            app.state.history_memo.min_bytes = 0
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as c:
                yield c, engine, app


def _loop(tmp_path, *, min_messages: int, edit_at: int | None = None, deep_at: int | None = None, header: bool = False):
    """A TURNS-turn tool loop through the real app; returns (engine requests, responses, memo)."""

    async def main():
        replies = []
        async with _serving(tmp_path, min_messages) as (c, engine, app):
            msgs = [{"role": "system", "content": "You run commands."}, {"role": "user", "content": "Build the project."}]
            for k in range(TURNS):
                if k == edit_at:
                    msgs[3] = {**msgs[3], "content": msgs[3]["content"] + " EDITED-OUTPUT"}
                if k == deep_at:
                    msgs[-2] = {**msgs[-2], "extra": _nested(70)}  # the first message added since the last request
                r = await c.post("/v1/chat/completions", json={"messages": msgs, "tools": TOOLS},
                                 headers={"X-Session-Id": "s1"} if header else {})  # fmt: skip
                replies.append(r)
                if r.status_code != 200:
                    break
                m = r.json()["choices"][0]["message"]
                msgs = msgs + [
                    {"role": "assistant", "content": m.get("content"), "tool_calls": m["tool_calls"]},
                    {"role": "tool", "tool_call_id": m["tool_calls"][0]["id"], "content": f"ok {k}\n" * 3},
                ]
        return [req["input_ids"] for req in engine.requests], replies, app.state.history_memo

    return asyncio.run(main())


def _nested(depth: int):
    v: object = "x"
    for _ in range(depth):
        v = {"a": v}
    return v


def on_and_off(loop, tmp_path, **kw):
    """``loop`` with the memo on and off; asserts the memo was used and changed nothing the engine
    sees. Returns (engine requests, replies with it, replies without it)."""
    with_memo, replies, memo = loop(tmp_path / "a", min_messages=4, **kw)
    without, replies_off, memo_off = loop(tmp_path / "b", min_messages=10**9, **kw)
    assert memo.reused >= TURNS - 3 and memo_off.reused == 0  # the memo was used on (almost) every later turn
    assert memo.resent_parsed >= TURNS - 4 and memo_off.resent_parsed == 0  # and the bytes it had seen were not parsed again
    assert with_memo == without  # token for token, every turn
    return with_memo, replies, replies_off


@pytest.mark.parametrize("header", [False, True])
def test_a_long_tool_loop_sends_the_engine_what_it_sends_without_the_memo(tmp_path, header):
    with_memo, replies, replies_off = on_and_off(_loop, tmp_path, header=header)
    assert all(r.status_code == 200 for r in replies + replies_off)
    for a, b in zip(replies, replies_off):
        ma, mb = a.json()["choices"][0]["message"], b.json()["choices"][0]["message"]
        assert (ma["content"], [t["function"] for t in ma["tool_calls"]]) == (mb["content"], [t["function"] for t in mb["tool_calls"]])
    # every later turn was spliced onto the one before it (the memo changes no session matching)
    for prev, cur in zip(with_memo, with_memo[1:]):
        assert cur[: len(prev)] == prev


def test_an_edit_early_in_a_long_history_is_seen(tmp_path):
    sent, replies, memo = _loop(tmp_path, min_messages=4, edit_at=9)
    assert all(r.status_code == 200 for r in replies)
    assert memo.reused > 0
    edited = TOK.decode(sent[9])
    assert "EDITED-OUTPUT" in edited  # the edited tool result reached the engine: no stale reuse
    assert "EDITED-OUTPUT" not in TOK.decode(sent[8])


def test_a_deep_value_in_an_added_message_is_still_a_400(tmp_path):
    _, replies, memo = _loop(tmp_path, min_messages=4, deep_at=8)
    assert memo.reused > 0  # earlier turns used the memo, so the check ran on the added messages only
    last = replies[-1]
    assert len(replies) == 9 and last.status_code == 400, last.text
    assert "nested" in last.json()["error"]["message"]


def test_values_that_compare_equal_but_convert_differently_are_compared_as_json():
    memo = HistoryMemo(min_messages=3)
    head = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"n": 1}}}  # an object, not a string
    raw = head + [{"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    key = memo.key("chat", raw, None)
    conv = convert(raw, _message_converter(None), None)
    memo.keep(key, raw, None, conv, None, 100, keepable)
    assert conv.messages[2].tool_calls[0].arguments == '{"n":1}'
    same = orjson.loads(orjson.dumps(raw)) + [{"role": "user", "content": "next"}]
    assert memo.match(key, same).n == 4
    # {"n": 1.0} == {"n": 1} == {"n": True} in Python, but each is written out differently
    for other in (1.0, True):
        changed = orjson.loads(orjson.dumps(raw))
        changed[2]["tool_calls"][0]["function"]["arguments"] = {"n": other}
        reuse = memo.match(key, changed)
        assert reuse.n == 2  # only the messages before it are reused
        got = convert(changed, _message_converter(None), reuse)
        assert got.messages[2].tool_calls[0].arguments == orjson.dumps({"n": other}).decode()
        assert got.messages == convert(changed, _message_converter(None), None).messages
        assert got.chars == message_chars(got.messages)


def test_a_reused_conversion_counts_the_characters_a_full_count_does():
    memo = HistoryMemo(min_messages=3)
    raw = [{"role": "system", "content": "sys"}, {"role": "user", "content": "task"},
           {"role": "assistant", "content": "a", "reasoning_content": "think",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
           {"role": "tool", "tool_call_id": "c1", "content": "result"}]  # fmt: skip
    key = memo.key("chat", raw, None)
    memo.keep(key, raw, None, convert(raw, _message_converter(None), None), None, 100, keepable)
    longer = orjson.loads(orjson.dumps(raw)) + [{"role": "assistant", "content": "done"}, {"role": "user", "content": "more"}]
    reuse = memo.match(key, longer)
    assert reuse.n == 4
    got = convert(longer, _message_converter(None), reuse)
    assert got.chars == message_chars(got.messages) == (3 + 4 + 1 + 5 + 8 + 6 + 4 + 4, 3 + 4 + 6 + 4)


def test_a_moved_marker_reuses_the_messages_before_it_and_image_parts_are_never_kept():
    memo = HistoryMemo(min_messages=3)
    raw = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"},
           {"role": "user", "content": "v", "cache_control": {"type": "ephemeral"}}]  # fmt: skip
    key = memo.key("chat", raw, None)
    memo.keep(key, raw, None, convert(raw, _message_converter(None), None), None, 100, keepable)
    nxt = raw[:3] + [{"role": "user", "content": "v"}, {"role": "assistant", "content": "b"}]
    assert memo.match(key, nxt).n == 3  # the marker moved off message 3: messages 0-2 are reused
    assert not keepable({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]})
    assert not keepable("hi")
    with_image = raw[:3] + [{"role": "user", "content": [{"type": "text", "text": "look"}]}]
    memo.keep(key, with_image, None, convert(with_image, _message_converter(None), None), None, 100, keepable)
    assert len(memo._kept[key].raw) == 3  # kept up to the first message with content parts


def test_a_match_needs_the_exact_kept_messages_and_memory_stays_bounded():
    entry = 400 + 3 * ITEM_BYTES  # what each kept 3-message conversation below counts
    memo = HistoryMemo(min_messages=3, max_bytes=2 * entry + 100)
    raw = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    assert memo.key("chat", raw[:2], None) is None  # too short to bother
    key = memo.key("chat", raw, None)
    memo.keep(key, orjson.loads(orjson.dumps(raw)), None, convert(raw, _message_converter(None), None), None, 400, keepable)
    longer = raw + [{"role": "user", "content": "next"}]
    assert memo.match(key, longer).n == 3
    assert memo.match(key, longer, head="other system text") is None  # what precedes the messages must match too
    changed = [raw[0], {"role": "user", "content": "U"}, raw[2], longer[3]]
    assert memo.match(memo.key("chat", changed, None), changed) is None
    edited = [raw[0], {"role": "user", "content": "U"}, raw[2]]
    assert memo.match(key, edited).n == 1  # only the messages before the edit are reused
    assert convert(edited, _message_converter(None), memo.match(key, edited)).messages[1].content == "U"
    assert memo.key("chat", raw, "sess-1") != key  # a session header keeps look-alike conversations apart
    conv = convert(raw, _message_converter(None), None)
    for i in range(5):  # room for two: the oldest go first
        memo.keep(("k", i), raw, None, conv, None, 400, keepable)
    assert len(memo._kept) == 2 and memo._bytes == 2 * entry
    memo.keep(("big",), raw, None, conv, None, 2 * entry, keepable)  # larger than the whole bound: not kept
    assert ("big",) not in memo._kept


def _chat_tool_loop(t: int) -> list[dict]:
    return [{"role": "assistant", "content": None,
             "tool_calls": [{"id": f"call_{t:024d}", "type": "function", "function": {"name": "f", "arguments": f'{{"x": {t}}}'}}]},
            {"role": "tool", "tool_call_id": f"call_{t:024d}", "content": f'{{"step": {t}, "ok": true}}'}]  # fmt: skip


def _claude_tool_loop(t: int) -> list[dict]:  # tool inputs hold numbers: kept as JSON too (``exact``)
    return [{"role": "assistant", "content": [{"type": "tool_use", "id": f"toolu_{t:020d}", "name": "f", "input": {"x": t}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{t:020d}", "content": f"step {t} ok"}]}]  # fmt: skip


@pytest.mark.parametrize("dialect", ["chat", "messages"])
def test_the_bound_counts_what_a_kept_conversation_holds(dialect):
    """A tool loop of short messages holds several times its JSON in parsed objects and
    ``Message``s: the bound must count that, not the request bytes."""
    import tracemalloc

    from proxy.api.messages import _message_converter as messages_converter, keepable as messages_keepable

    turn, conv_item, keep_ok = ((_chat_tool_loop, _message_converter(None), keepable) if dialect == "chat" else
                                (_claude_tool_loop, messages_converter(None), messages_keepable))  # fmt: skip
    msgs = [{"role": "user", "content": "Build it."}] + [m for t in range(150) for m in turn(t)]
    raw = orjson.dumps({"messages": msgs})
    memo = HistoryMemo()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for s in range(10):
            body = orjson.loads(raw.replace(b"Build it.", b"Build it %d." % s))
            memo.keep(memo.key(dialect, body["messages"], None), body["messages"], None,
                      convert(body["messages"], conv_item, None), None, len(raw), keep_ok)  # fmt: skip
            del body
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(memo._kept) == 10
    assert held > 3 * 10 * len(raw)  # what the request bytes alone would have counted is far too little
    assert memo._bytes >= held  # the estimate covers what is really held


def _anthropic_loop(tmp_path, *, min_messages: int, edit_at: int | None = None):
    """A Claude Code-like loop over /v1/messages: tool_use inputs holding numbers, tool_result
    blocks, and a cache_control marker that moves to the newest message every turn."""

    async def main():
        tools = [{"name": "run", "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}}}}]
        replies = []
        async with _serving(tmp_path, min_messages) as (c, engine, app):
            msgs = [{"role": "user", "content": [{"type": "text", "text": "Build the project."}]}]
            for k in range(TURNS):
                if k == edit_at:
                    msgs[2] = {**msgs[2], "content": [{**msgs[2]["content"][0], "content": "EDITED-OUTPUT"}]}
                marked = [dict(m) for m in msgs]
                last = dict(marked[-1])
                last["content"] = [*last["content"][:-1], {**last["content"][-1], "cache_control": {"type": "ephemeral"}}]
                marked[-1] = last
                body = {"model": "m", "max_tokens": 256, "system": [{"type": "text", "text": "You run commands."}],
                        "messages": marked, "tools": tools}  # fmt: skip
                r = await c.post("/v1/messages", json=body, headers={"x-claude-code-session-id": "cc-1"})
                replies.append(r)
                assert r.status_code == 200, r.text
                use = next(b for b in r.json()["content"] if b["type"] == "tool_use")
                use = {**use, "input": {**use["input"], "timeout": 120000, "verbose": True}}  # numbers and booleans
                msgs = msgs + [
                    {"role": "assistant", "content": [use]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": f"ok {k}"}]},
                ]
        return [req["input_ids"] for req in engine.requests], replies, app.state.history_memo

    return asyncio.run(main())


def test_a_claude_code_like_loop_sends_the_engine_what_it_sends_without_the_memo(tmp_path):
    with_memo, _, _ = on_and_off(_anthropic_loop, tmp_path)
    for prev, cur in zip(with_memo, with_memo[1:]):
        assert cur[: len(prev)] == prev  # spliced every turn
    assert '"timeout": 120000' in TOK.decode(with_memo[-1]) or '"timeout":120000' in TOK.decode(with_memo[-1])


def test_an_edited_tool_result_in_a_claude_code_like_loop_is_seen(tmp_path):
    sent, _, memo = _anthropic_loop(tmp_path, min_messages=4, edit_at=9)
    assert memo.reused > 0
    assert "EDITED-OUTPUT" in TOK.decode(sent[9]) and "EDITED-OUTPUT" not in TOK.decode(sent[8])


def _random_chat(rnd, n: int) -> list[dict]:
    """Random chat messages with tool calls, some call ids used twice, some numbers in arguments."""
    out: list[dict] = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    for i in range(n):
        kind = rnd.choice(["call", "call", "tool", "user", "assistant"])
        if kind == "call":
            cid = f"c{rnd.randrange(6)}"  # a small pool: ids repeat
            args = {"n": rnd.choice([1, 1.0, True, "1"])} if rnd.random() < 0.3 else f'{{"i": {i}}}'
            out.append({"role": "assistant", "content": None,
                        "tool_calls": [{"id": cid, "type": "function", "function": {"name": f"f{i}", "arguments": args}}]})  # fmt: skip
        elif kind == "tool":
            out.append({"role": "tool", "tool_call_id": f"c{rnd.randrange(6)}", "content": f"r{i}"})
        else:
            out.append({"role": kind, "content": f"{kind} {i}"})
    return out


def test_any_continuation_of_a_random_chat_converts_as_from_scratch():
    """Reuses that drop kept messages (a moved marker, an edit) keep names, ids and character
    counts exact, duplicate call ids included."""
    import random

    rnd = random.Random(11)
    memo = HistoryMemo(min_messages=3)
    reused = 0
    for trial in range(300):
        seq = _random_chat(rnd, rnd.randrange(3, 25))
        a = rnd.randrange(3, len(seq) + 1)
        first = seq[:a]
        second = orjson.loads(orjson.dumps(seq))
        if rnd.random() < 0.3:  # the last message of the first request changed (a marker moved), or an earlier one
            j = a - 1 if rnd.random() < 0.5 else rnd.randrange(a)
            second[j] = {**second[j], "cache_control": {"type": "ephemeral"}}
        if rnd.random() < 0.3:  # an edited text anywhere
            j = rnd.randrange(len(second))
            second[j] = {**second[j], "content": f"edited {trial}"}
        key = memo.key("chat", first, f"t{trial}")
        memo.keep(key, first, None, convert(first, _message_converter(None), None), None, 100, keepable)
        reuse = memo.match(key, second)
        reused += reuse is not None
        got = convert(second, _message_converter(None), reuse)
        want = convert(second, _message_converter(None), None)
        assert (got.messages, got.ids, got.names, got.chars, got.calls) == (want.messages, want.ids, want.names, want.chars, want.calls), trial
        memo.keep(key, second, None, got, reuse, 100, keepable)  # kept from a reuse: the next match still exact
        third = orjson.loads(orjson.dumps(second)) + [{"role": "user", "content": "more"}]
        again = convert(third, _message_converter(None), memo.match(key, third))
        assert again.messages == convert(third, _message_converter(None), None).messages
    assert reused > 150
