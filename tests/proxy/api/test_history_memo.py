"""A chat conversation's next request converts only the messages it adds (proxy/api/history_memo.py).

The reuse must be invisible: a long tool loop sends the engine exactly what the same loop sends
with the memo off, an edit anywhere in the history is seen (the edited text reaches the
engine), a deep value in an added message is still a 400, and values that compare equal but
convert differently (``1 == 1.0``) are never reused."""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest
import respx

from engines.pool import EnginePool
from proxy.api.history_memo import Converted, HistoryMemo, plain
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


def _loop(tmp_path, *, min_messages: int, edit_at: int | None = None, deep_at: int | None = None, header: bool = False):
    """A TURNS-turn tool loop through the real app; returns (engine requests, responses, memo)."""

    async def main():
        with respx.mock(assert_all_called=False) as router:
            engine = FakeSGLang(router, URL, context_length=32_768)
            engine.script = [_step(k) for k in range(TURNS)]
            app = create_app(Settings(store=str(tmp_path / "s.sqlite"), engine_url=[URL]), fmt=ChatFormat(TOK, "qwen3"),
                             pool=EnginePool("sglang", [URL], health_interval_s=0))  # fmt: skip
            app.state.history_memo.min_messages = min_messages
            replies = []
            async with app.router.lifespan_context(app):
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as c:
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


@pytest.mark.parametrize("header", [False, True])
def test_a_long_tool_loop_sends_the_engine_what_it_sends_without_the_memo(tmp_path, header):
    with_memo, replies, memo = _loop(tmp_path / "a", min_messages=4, header=header)
    without, replies_off, memo_off = _loop(tmp_path / "b", min_messages=10**9, header=header)
    assert all(r.status_code == 200 for r in replies + replies_off)
    assert memo.reused >= TURNS - 3 and memo_off.reused == 0  # the memo was used on (almost) every later turn
    assert with_memo == without  # token for token, every turn
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


def test_only_messages_whose_equal_values_convert_alike_are_kept():
    assert plain({"role": "user", "content": "hi"})
    assert plain({"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]})
    # {"a": 1} == {"a": 1.0} == {"a": True}, but each would be written out differently
    assert not plain({"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {"a": 1}}}]})
    assert not plain({"role": "user", "content": [{"type": "text", "text": "hi"}]})  # parts (images) resolve per request
    assert not plain("hi")


def test_a_match_needs_the_exact_kept_messages_and_memory_stays_bounded():
    memo = HistoryMemo(min_messages=3, max_bytes=1000)
    raw = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    assert memo.key(raw[:2], None) is None  # too short to bother
    key = memo.key(raw, None)
    memo.keep(key, Converted(orjson.loads(orjson.dumps(raw)), (), (), {}, 400))
    longer = raw + [{"role": "user", "content": "next"}]
    assert memo.match(key, longer) is not None
    changed = [raw[0], {"role": "user", "content": "U"}, raw[2], longer[3]]
    assert memo.match(memo.key(changed, None), changed) is None
    assert memo.match(key, raw[:2] + [{"role": "assistant", "content": "b"}]) is None
    assert memo.key(raw, "sess-1") != key  # a session header keeps look-alike conversations apart
    for i in range(5):  # 400 bytes each against a 1000-byte bound: the oldest go first
        memo.keep(("k", i), Converted([], (), (), {}, 400))
    assert len(memo._kept) == 2 and memo._bytes == 800
    memo.keep(("big",), Converted([], (), (), {}, 5000))  # larger than the whole bound: not kept
    assert ("big",) not in memo._kept
