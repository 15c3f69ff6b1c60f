"""The Responses API's input conversion and stored conversation reuse the last request's work
(proxy/api/history_memo.py, proxy/api/responses_conversation.py).

Responses items merge (a reasoning item, an assistant message and the function calls after
them are one assistant message), so a reuse may only restart where no message is half built.
The reuse must be invisible: a Codex-like loop that resends its whole input sends the engine
exactly what it sends with the memo off, ``previous_response_id`` expands to the same
conversation, an edit is seen, and any prefix and continuation of random item sequences
converts as a conversion from scratch does."""

from __future__ import annotations

import asyncio
import random

import orjson

from proxy.api.content import name_tool_messages
from proxy.api.history_memo import NOT_KEPT, HistoryMemo, convert
from proxy.api.images import ImageRequest
from proxy.api.responses import _InputConverter, input_to_messages, keepable, memo_head
from proxy.api.responses_conversation import _ConversationJSON, message_to_dict
from proxy.session.planner import message_chars
from tests.fakes.engines import Step
from tests.proxy.api.test_history_memo import TOK, TURNS, _serving, on_and_off
from tokenization.conversation import Message, ToolCall

TOOLS = [{"type": "function", "name": "run", "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}]


def _step(k: int) -> Step:
    text = f'<think>\nstep {k} next\n</think>\n\n<tool_call>\n{{"name": "run", "arguments": {{"cmd": "step {k}"}}}}\n</tool_call><|im_end|>'
    return Step(tokens=[(t, -0.25 - i / 1024) for i, t in enumerate(TOK.encode(text, add_special_tokens=False))])


def _loop(tmp_path, *, min_messages: int, edit_at: int | None = None):
    """A Codex-like loop over /v1/responses (the whole input every turn, output items echoed,
    then one turn continued by previous_response_id): (engine requests, replies, memo)."""

    async def main():
        replies = []
        async with _serving(tmp_path, min_messages) as (c, engine, app):
            engine.script = [_step(k) for k in range(TURNS + 1)]
            items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Build the project."}]}]
            for k in range(TURNS):
                if k == edit_at:
                    items[3] = {**items[3], "output": items[3]["output"] + " EDITED-OUTPUT"}
                r = await c.post("/v1/responses", json={"instructions": "You run commands.", "input": items, "tools": TOOLS})
                replies.append(r)
                assert r.status_code == 200, r.text
                out = r.json()["output"]
                call = next(o for o in out if o["type"] == "function_call")
                items = items + out + [{"type": "function_call_output", "call_id": call["call_id"], "output": f"ok {k}\n" * 3}]
            last = replies[-1].json()["id"]
            r = await c.post("/v1/responses", json={"previous_response_id": last, "tools": TOOLS,
                                                   "input": [{"role": "user", "content": "Now summarise."}]})  # fmt: skip
            assert r.status_code == 200, r.text
            replies.append(r)
        return [req["input_ids"] for req in engine.requests], replies, app.state.history_memo

    return asyncio.run(main())


def test_a_codex_like_loop_sends_the_engine_what_it_sends_without_the_memo(tmp_path):
    with_memo, replies, replies_off = on_and_off(_loop, tmp_path)  # the previous_response_id turn too
    assert [r.json()["output"][-1]["arguments"] for r in replies[:-1]] == [r.json()["output"][-1]["arguments"] for r in replies_off[:-1]]
    loop = with_memo[:TURNS]  # the previous_response_id turn has no instructions (OpenAI's rule)
    for prev, cur in zip(loop, loop[1:]):
        assert cur[: len(prev)] == prev  # spliced every turn
    assert "step 3 next" in TOK.decode(loop[-1])  # the sampled reasoning stays in the spliced history


def test_an_edit_early_in_a_long_input_is_seen(tmp_path):
    sent, _, memo = _loop(tmp_path, min_messages=4, edit_at=9)
    assert memo.reused > 0
    assert "EDITED-OUTPUT" in TOK.decode(sent[9]) and "EDITED-OUTPUT" not in TOK.decode(sent[8])


def _random_items(rnd: random.Random, n: int) -> list[dict]:
    """Random Responses input: messages, reasoning, assistant messages, calls and their outputs
    in orders that merge and split assistant turns every way."""
    items: list[dict] = []
    for i in range(n):
        kind = rnd.choice(["user", "assistant", "reasoning", "call", "call", "output", "developer"])
        if kind in ("user", "developer"):
            content = f"{kind} {i}" if rnd.random() < 0.5 else [{"type": "input_text", "text": f"{kind} {i}"}]
            items.append({"type": "message", "role": kind, "content": content})
        elif kind == "assistant":
            items.append({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": f"said {i}"}]})
        elif kind == "reasoning":
            items.append({"type": "reasoning", "summary": [{"type": "summary_text", "text": f"thought {i}"}]})
        elif kind == "call":
            items.append({"type": "function_call", "call_id": f"c{i}", "name": f"f{i % 3}", "arguments": f'{{"n": {i}}}'})
        else:
            calls = [it["call_id"] for it in items if it["type"] == "function_call"]
            items.append({"type": "function_call_output", "call_id": rnd.choice(calls) if calls else f"x{i}", "output": f"out {i}"})
    return items


def _from_scratch(items: list[dict]) -> tuple[list[Message], list[str]]:
    msgs, ids = input_to_messages(items)
    return name_tool_messages(msgs), ids


def test_any_continuation_of_random_input_converts_as_from_scratch():
    rnd = random.Random(7)
    memo = HistoryMemo(min_messages=3)
    checked = reused = 0
    for trial in range(300):
        seq = _random_items(rnd, rnd.randrange(4, 30))
        a = rnd.randrange(3, len(seq))
        first, second = seq[:a], orjson.loads(orjson.dumps(seq))  # equal items, not the same objects
        if rnd.random() < 0.2:  # an edit somewhere in the part the first request had
            j = rnd.randrange(a)
            second[j] = {**second[j], "status": "edited"} if rnd.random() < 0.5 else _random_items(rnd, 1)[0]
        key = memo.key("responses", first, f"t{trial}")
        conv = convert(first, _InputConverter(None, ImageRequest(None)), None)
        assert (conv.messages, conv.ids) == _from_scratch(first)
        memo.keep(key, first, None, conv, None, 100, keepable)
        reuse = memo.match(key, second)
        if reuse is not None:
            reused += 1
            assert reuse.n in memo._kept[key].starts  # never inside an assistant turn being built
        got = convert(second, _InputConverter(None, ImageRequest(None)), reuse)
        assert (got.messages, got.ids) == _from_scratch(second), (trial, a)
        assert got.chars == message_chars(got.messages)
        checked += 1
    assert checked == 300 and reused > 150


def test_a_reuse_restarts_at_the_assistant_turn_still_being_built():
    items = [{"role": "user", "content": "go"}, {"type": "reasoning", "summary": [{"type": "summary_text", "text": "hm"}]},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}]  # fmt: skip
    memo = HistoryMemo(min_messages=3)
    key = memo.key("responses", items, None)
    memo.keep(key, items, None, convert(items, _InputConverter(None, ImageRequest(None)), None), None, 100, keepable)
    more = items + [{"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c2", "output": "done"}]  # fmt: skip
    reuse = memo.match(key, more)
    assert reuse.n == 1  # the reasoning and first call are converted again, with the second call
    got = convert(more, _InputConverter(None, ImageRequest(None)), reuse)
    assert [tc.id for tc in got.messages[1].tool_calls] == ["c1", "c2"] and got.messages[1].reasoning == "hm"
    assert got.messages[2] == Message(role="tool", content="done", tool_call_id="c2", name="g")


def test_what_depends_on_more_than_the_item_is_never_kept():
    assert keepable({"type": "message", "role": "user", "content": [{"type": "input_text", "text": "t"}]})
    assert keepable({"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"})
    assert not keepable({"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]})
    assert not keepable({"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image", "image_url": "x"}]})
    assert not keepable({"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}", "namespace": "ns"})
    for typ in ("computer_call_output", "item_reference", "compaction_trigger"):
        assert not keepable({"type": typ, "id": "x", "call_id": "c"})
    assert memo_head({"previous_response_id": "resp_1", "input": []}) is NOT_KEPT  # its input is what it adds
    assert memo_head({"input": "hello"}) is NOT_KEPT and memo_head({"input": []}) is None


def test_the_stored_conversation_is_the_json_a_full_dump_writes():
    def ref(ms):
        return orjson.dumps([message_to_dict(m) for m in ms])

    rnd = random.Random(3)
    cache = _ConversationJSON(max_bytes=4000)
    hist = [Message(role="user", content="task")]
    for t in range(200):
        call = ToolCall(f"c{t}", "f", '{"x": %d}' % t)
        returned = Message(role="assistant", content="", reasoning=f"r{t}" if t % 2 else None, tool_calls=(call,))
        assert cache.dumps(hist + [returned]) == ref(hist + [returned])
        echo = returned if rnd.random() < 0.5 else Message(role="assistant", content="", tool_calls=(call,))  # equal or not
        hist = hist + [echo, Message(role="tool", content=f"ok {t}", tool_call_id=f"c{t}")]
        if rnd.random() < 0.1:  # an edit
            k = rnd.randrange(len(hist))
            hist = hist[:k] + [Message(role="user", content="edited")] + hist[k + 1 :]
            assert cache.dumps(hist) == ref(hist)
        if rnd.random() < 0.05:  # a client that dropped its tail
            hist = hist[: rnd.randrange(1, len(hist))]
            assert cache.dumps(hist) == ref(hist)
        assert cache._bytes <= cache.max_bytes
    assert cache.dumps([]) == b"[]"
