"""A long request is parsed from the bytes it adds to its conversation's last request
(proxy/api/resent_bytes.py, ``HistoryMemo.resent``).

The cut must be invisible: whatever the next request's bytes are (appended items, an edit, a
moved marker, another field before or after the items, a second ``messages`` key, a trailing
comma, pretty-printed JSON), the body is what parsing all of them gives (orjson, compared as
the JSON it writes, so ``1``, ``1.0`` and ``True`` stay apart), and a body that does not parse
is the same 400."""

from __future__ import annotations

import asyncio
import json
import random

import orjson
import pytest

from proxy.api.chat import _message_converter, keepable
from proxy.api.history_memo import HistoryMemo, convert, read_body
from proxy.api.resent_bytes import Layout, field_start, layout_of, shared_items
from proxy.errors import APIError
from tests.proxy.api.test_history_memo import TOK, TURNS, _random_chat, _serving


def _send(memo: HistoryMemo, raw: bytes, sid: str | None = None):
    """What the chat route does with a body: read it, convert it, keep it. Returns the body."""
    body, found = read_body(raw, memo, "chat", sid)
    msgs = body["messages"]
    conv = convert(msgs, _message_converter(None), found.reuse)
    memo.keep(found.key, msgs, None, conv, found.reuse, found.cost, keepable, found.layout)
    return body


def _full(raw: bytes):
    try:
        return orjson.dumps(orjson.loads(raw))
    except orjson.JSONDecodeError:
        return "invalid"


def _read(memo: HistoryMemo, raw: bytes):
    try:
        return orjson.dumps(_send(memo, raw))
    except APIError as exc:
        assert exc.status == 400 and exc.code == "invalid_json", exc
        return "invalid"


def _dump(body: dict, rnd: random.Random) -> bytes:
    """A client's compact JSON: orjson's, or Python's as httpx writes it."""
    if rnd.random() < 0.5:
        return orjson.dumps(body)
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def _variant(rnd: random.Random, body: dict, trial: int) -> bytes:
    """The next request: more messages, sometimes an edit, a moved marker, other fields, or a
    body that is broken or tricky in its bytes."""
    msgs = orjson.loads(orjson.dumps(body["messages"]))
    msgs += _random_chat(rnd, rnd.randrange(0, 4))[2:]
    r = rnd.random()
    if r < 0.15:
        j = rnd.randrange(len(msgs))
        msgs[j] = {**msgs[j], "content": f"edited {trial}"}
    elif r < 0.3:
        msgs[-1] = {**msgs[-1], "cache_control": {"type": "ephemeral"}}
    nxt = {**body, "messages": msgs}
    if rnd.random() < 0.2:
        nxt["temperature"] = rnd.choice([0, 0.5, 1.0, True])
    raw = _dump(nxt, rnd)
    r = rnd.random()
    if r < 0.05:  # the field a second time: the last one wins
        raw = raw[:-1] + b',"messages":[{"role":"user","content":"again"}]}'
    elif r < 0.1:  # some of the same messages and a trailing comma: not JSON
        short = orjson.dumps(body["messages"][: rnd.randrange(1, len(body["messages"]) + 1)])[:-1] + b",]"
        rest = {k: v for k, v in body.items() if k != "messages"}
        around = [b'"%b":%b' % (k.encode(), orjson.dumps(v)) for k, v in rest.items()]
        at = list(body).index("messages")
        raw = b"{" + b",".join([*around[:at], b'"messages":' + short, *around[at:]]) + b"}"
    elif r < 0.15:
        raw = json.dumps(nxt, indent=1).encode()
    elif r < 0.2:  # cut anywhere
        raw = raw[: rnd.randrange(len(raw))]
    return raw


@pytest.mark.parametrize("first", ["messages", "tools"])
def test_any_next_request_parses_as_a_full_parse_does(first):
    rnd = random.Random(7)
    memo = HistoryMemo(min_messages=3, min_bytes=0)
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object", "properties": {"messages": {"type": "array"}}}}} for i in range(3)]
    hits = invalid = 0
    for trial in range(400):
        sid = f"s{trial % 7}" if rnd.random() < 0.5 else None
        msgs = _random_chat(rnd, rnd.randrange(1, 12))
        body = {"tools": tools, "model": "m", "messages": msgs} if first == "tools" else {"model": "m", "messages": msgs, "tools": tools}
        _send(memo, _dump(body, rnd), sid)
        for _ in range(3):
            raw = _variant(rnd, body, trial)
            before = memo.resent_parsed
            want = _full(raw)
            assert _read(memo, raw) == want, (trial, raw[-200:])
            hits += memo.resent_parsed > before
            invalid += want == "invalid"
            if want == "invalid":
                break
            body = orjson.loads(raw)
            if body.get("messages") is None or not isinstance(body["messages"], list):
                break
    assert hits > 300 and invalid > 20  # the cut was taken on most requests, and broken bodies were seen


def test_a_layout_is_where_the_items_are():
    msgs = _random_chat(random.Random(3), 20)
    raw = orjson.dumps({"model": "m", "metadata": {"note": '"messages":['}, "messages": msgs, "tools": []})
    start = field_start(raw, "messages")
    assert raw[start : start + 2] == b"[{"
    lay = layout_of(raw, orjson.loads(raw), "messages", start, msgs)
    assert lay is not None and len(lay.ends) == len(msgs)
    for i, end in enumerate(lay.ends):  # each prefix of the array's bytes is that many items
        assert orjson.loads(raw[start:end] + b"]") == msgs[: i + 1]
    assert shared_items(raw, lay) == len(msgs)
    assert shared_items(raw[: lay.ends[4]] + b',{"role":"user","content":"x"}]}', lay) == 5


def test_a_look_alike_array_gets_no_layout():
    """A nested ``"messages":[`` holding the same items, found before the real field: cutting
    there would not give the body without its items, so no layout is built."""
    msgs = _random_chat(random.Random(5), 10)
    items = orjson.dumps(msgs)
    for raw in (b'{"metadata":{"messages":%b},"messages":%b}' % (items, items),
                b'{"messages" :%b,"metadata":{"messages":%b}}' % (items, items)):  # the real one not compact
        body = orjson.loads(raw)
        assert body["messages"] == msgs
        assert layout_of(raw, body, "messages", field_start(raw, "messages"), msgs) is None
    raw = b'{"metadata":{"messages":%b},"messages":%b}' % (items, items)
    lay = layout_of(raw, orjson.loads(raw), "messages", raw.rfind(b'"messages":[') + 11, msgs)
    assert lay is not None and len(lay.ends) == len(msgs)  # the real one does


def test_pretty_printed_requests_are_parsed_in_full():
    memo = HistoryMemo(min_messages=3, min_bytes=0)
    msgs = _random_chat(random.Random(9), 12)
    for n in (10, 11, 12):
        raw = json.dumps({"model": "m", "messages": msgs[:n]}, indent=2).encode()
        assert orjson.dumps(_send(memo, raw)) == orjson.dumps(orjson.loads(raw))
    assert memo.resent_parsed == 0 and memo.reused == 2  # the conversion memo still works


def test_kept_objects_are_never_changed_by_a_request():
    """The next request's body holds the kept items themselves: nothing downstream may edit them."""
    memo = HistoryMemo(min_messages=3, min_bytes=0)
    msgs = _random_chat(random.Random(4), 12)
    _send(memo, orjson.dumps({"model": "m", "messages": msgs}))
    body = _send(memo, orjson.dumps({"model": "m", "messages": msgs + [{"role": "user", "content": "more"}]}))
    assert memo.resent_parsed == 1 and body["messages"] == msgs + [{"role": "user", "content": "more"}]
    (entry,) = memo._kept.values()
    assert entry.raw[0] is body["messages"][0]
    assert isinstance(entry.layout, Layout) and entry.layout.body.endswith(b'"more"}]}')


def _chat_loop(tmp_path, memo_on: bool):
    """A header-less tool loop with a 24 KB system prompt through the real app, the memo at its
    defaults (on) or off: (engine requests, memo)."""

    async def main():
        async with _serving(tmp_path, 8) as (c, engine, app):
            memo = app.state.history_memo
            memo.min_bytes = HistoryMemo().min_bytes  # the default, not the tests' 0
            if not memo_on:
                memo.min_messages, memo.min_bytes = 10**9, 10**12
            system = "".join(f"Rule {i}: keep the build green and the \"tests\" passing.\n" for i in range(400))
            msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Build the project."}]
            tools = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}]
            for k in range(TURNS):
                r = await c.post("/v1/chat/completions", json={"messages": msgs, "tools": tools})
                assert r.status_code == 200, r.text
                m = r.json()["choices"][0]["message"]
                msgs = msgs + [
                    {"role": "assistant", "content": m.get("content"), "tool_calls": m["tool_calls"]},
                    {"role": "tool", "tool_call_id": m["tool_calls"][0]["id"], "content": f"ok {k}"},
                ]
            scraped = (await c.get("/metrics")).text
            assert f'splice_history_reuse_total{{kind="bytes"}} {float(memo.resent_parsed)}' in scraped
            assert f'splice_history_reuse_total{{kind="conversion"}} {float(memo.reused)}' in scraped
        return [req["input_ids"] for req in engine.requests], memo

    return asyncio.run(main())


def test_a_long_conversation_at_the_defaults_is_parsed_from_what_it_adds(tmp_path):
    on, memo = _chat_loop(tmp_path / "on", True)
    off, memo_off = _chat_loop(tmp_path / "off", False)
    assert memo.resent_parsed >= TURNS - 2 and memo_off.resent_parsed == 0
    assert on == off  # token for token, every turn
    assert "Rule 399" in TOK.decode(on[-1])



def test_a_group_of_sessions_sharing_a_long_start_finds_each_its_own(monkeypatch):
    """Header-less sessions of one task (a group) share their first two items, here a long
    document, and part at the first answer. Each request must find its own conversation among
    many look-alikes, and compare everything before the answer with that one alone: the prefix
    search over a 400 KB start cost ~50 us per look-alike, up to 64 of them per turn."""
    import proxy.api.history_memo as hm

    searched = []
    monkeypatch.setattr(hm, "shared_items", lambda raw, layout: searched.append(1) or shared_items(raw, layout))
    memo = HistoryMemo()
    doc = "the file to work on: " + " ".join(str(i) for i in range(60_000))
    n = 150  # more than the look-alikes a request is compared with before
    convs = {s: [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": doc}] for s in range(n)}
    for turn in range(3):
        for s, msgs in convs.items():
            call = {"id": f"call_{s}_{turn}", "type": "function", "function": {"name": "run", "arguments": "{}"}}
            # the same words in every session: only the call id, 64 bytes in, tells them apart
            msgs.append({"role": "assistant", "content": "I will run the tests first, then read the failing one.", "tool_calls": [call]})
            msgs.append({"role": "tool", "tool_call_id": f"call_{s}_{turn}", "content": f"step {turn} of session {s}"})
            raw = orjson.dumps({"model": "m", "messages": msgs})
            before, searched[:] = memo.resent_parsed, []
            body = _send(memo, raw)
            assert orjson.dumps(body) == orjson.dumps(orjson.loads(raw))
            if turn:  # its own last request is kept: parsed from what it adds, one prefix search
                assert memo.resent_parsed == before + 1, (turn, s)
                assert len(searched) == 1, (turn, s, len(searched))
