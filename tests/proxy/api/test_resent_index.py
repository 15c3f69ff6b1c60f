"""The index of kept layouts (proxy/api/resent_index.py): a long request finds the conversations
it may repeat by looking them up, never missing one the byte comparison would accept, and
only those (with 300 look-alike sessions, more than a scan ever looked at)."""

from __future__ import annotations

import random

import orjson
import pytest

from proxy.api.history_memo import HistoryMemo
from proxy.api.resent_bytes import WINDOW, Layout, extend_ends
from proxy.api.resent_index import LayoutIndex
from tests.proxy.api.test_resent_bytes import _send

SCOPE = ("chat", None)


def _layout(msgs: list[dict]) -> Layout:
    raw = orjson.dumps({"model": "m", "messages": msgs})
    start = raw.index(b'"messages":[') + 11
    return Layout(raw, start, extend_ends(raw, start, (), msgs))


def _accepts(raw: bytes, old: Layout) -> bool:
    """The byte checks ``HistoryMemo.resent`` makes before its prefix search, spelled out."""
    if raw[old.start + 1 : old.start + 1 + WINDOW] != old.body[old.start + 1 : old.start + 1 + WINDOW]:
        return False
    if any(raw[e + 1 : e + 1 + WINDOW] != old.body[e + 1 : e + 1 + WINDOW] for e in old.ends[:2]):
        return False
    return len(old.ends) <= 2 or raw.startswith(old.body[old.ends[1] + 1 : old.ends[2] + 1], old.ends[1] + 1)


def _conversation(rnd: random.Random) -> list[dict]:
    """A short random conversation over few choices, so that many share their first items."""
    system = rnd.choice(["You are a coding agent. " * 4, "You are a helpful assistant. " * 4])
    msgs = [{"role": "system", "content": system}]
    for _ in range(rnd.randrange(0, 5)):
        msgs.append({"role": "user", "content": rnd.choice(["Fix the test.", "Fix the test. " * 8, "Write docs."])})
        text = rnd.choice([None, "I will read the file first and then run the tests to see what fails.", "ok"])
        call = f"call_{rnd.choice(['0193ab', '0193ac'])}{rnd.randrange(3):02d}_0"
        msgs.append({"role": "assistant", "content": text,
                     "tool_calls": [{"id": call, "type": "function", "function": {"name": "run", "arguments": "{}"}}]})  # fmt: skip
    return msgs


@pytest.mark.parametrize("keys", [3, 200])  # buckets handed over whole, and looked up
def test_the_index_never_misses_a_layout_the_byte_checks_accept(keys):
    rnd = random.Random(keys)
    index = LayoutIndex()
    kept: dict[int, Layout] = {}
    for step in range(3000):
        if kept and rnd.random() < 0.3:  # forget one
            key = rnd.choice(list(kept))
            index.remove(SCOPE, key, kept.pop(key))
        elif rnd.random() < 0.5:  # keep one (again: removed first, as HistoryMemo.keep does)
            key = rnd.randrange(keys)
            if key in kept:
                index.remove(SCOPE, key, kept.pop(key))
            kept[key] = _layout(_conversation(rnd))
            index.add(SCOPE, key, kept[key])
        else:  # a request
            new = _layout(_conversation(rnd))
            found = index.candidates(SCOPE, new.body, new.start, limit=10_000)
            want = {k for k, old in kept.items() if _accepts(new.body, old)}
            assert want <= set(found), step
            assert len(found) == len(set(found))
    for key in list(kept):
        index.remove(SCOPE, key, kept.pop(key))
    assert not index._roots and not index._all  # nothing left behind


def test_candidates_come_newest_first_and_only_the_look_alikes():
    index = LayoutIndex()
    base = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "Fix the test."}]
    layouts = {}
    for k in range(5):
        msgs = base + [{"role": "assistant", "content": f"answer number {k} " * 10}]
        layouts[k] = _layout(msgs + [{"role": "user", "content": "more"}])
        index.add(SCOPE, k, layouts[k])
    index.remove(SCOPE, 1, layouts[1])
    index.add(SCOPE, 1, layouts[1])  # kept again: now the newest
    same_start = _layout(base + [{"role": "assistant", "content": "answer number 3 " * 10}, {"role": "user", "content": "x"}])
    assert index.candidates(SCOPE, same_start.body, same_start.start, 10) == [3]
    # layouts cut short (HistoryMemo.keep stops at an item it does not keep) are indexed by the
    # items they have: the third item's start with two, the second's with one
    three = layouts[3]
    index.add(SCOPE, "two", Layout(three.body, three.start, three.ends[:2]))
    index.add(SCOPE, "one", Layout(three.body, three.start, three.ends[:1]))
    assert index.candidates(SCOPE, same_start.body, same_start.start, 10) == ["one", "two", 3]
    other = _layout(base + [{"role": "assistant", "content": "something else entirely " * 4}, {"role": "user", "content": "x"}])
    assert index.candidates(SCOPE, other.body, other.start, 10) == ["one"]
    answer = {"role": "assistant", "content": "answer number 3 " * 10}
    other_task = _layout([base[0], {"role": "user", "content": "Write the docs."}, answer, {"role": "user", "content": "x"}])
    assert index.candidates(SCOPE, other_task.body, other_task.start, 10) == []
    assert index.candidates(("chat", "another session"), same_start.body, same_start.start, 10) == []
    assert index.candidates(SCOPE, layouts[1].body, layouts[1].start, 10) == ["one", 1]


def test_three_hundred_look_alike_sessions_each_find_their_own():
    """Header-less sessions of one task whose first answers are tool calls with time-ordered ids
    (alike in their first 64 bytes): every one, the oldest too, is parsed from what it adds."""
    memo = HistoryMemo()
    doc = "the file to work on:\n" + "x = 1  # line\n" * 2000
    n = 300
    convs = {}
    for s in range(n):
        msgs = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": doc}]
        call = {"id": f"call_0193ab4f{s:016x}_0", "type": "function", "function": {"name": "run", "arguments": "{}"}}
        msgs += [{"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "tool_call_id": call["id"], "content": "ok"}]
        _send(memo, orjson.dumps({"model": "m", "messages": msgs}))
        convs[s] = msgs
    for s, msgs in convs.items():
        msgs += [{"role": "user", "content": f"go on {s}"}]
        raw = orjson.dumps({"model": "m", "messages": msgs})
        start = raw.index(b'"messages":[') + 11
        assert len(memo._layouts.candidates(("chat", None), raw, start, 10_000)) == 1
        before = memo.resent_parsed
        body = _send(memo, raw)
        assert orjson.dumps(body) == raw
        assert memo.resent_parsed == before + 1, s


def test_a_request_looks_up_its_own_items_not_every_task(monkeypatch):
    """200 sessions of one system prompt, each its own task (of its own length): a request takes
    one step per item down the index, not one per task."""
    import proxy.api.resent_index as ri

    steps = []
    edge = ri._edge
    monkeypatch.setattr(ri, "_edge", lambda *a: steps.append(1) or edge(*a))
    index = LayoutIndex()
    system = {"role": "system", "content": "You are a coding agent. " * 4}
    convs = {}
    for s in range(200):
        task = {"role": "user", "content": f"Task {s}: fix issue #{s}. " + "Details follow. " * (s % 50)}
        call = {"id": f"call_0193ab4f{s:016x}_0", "type": "function", "function": {"name": "run", "arguments": "{}"}}
        convs[s] = [system, task, {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "tool_call_id": call["id"], "content": "ok"}]
        index.add(SCOPE, s, _layout(convs[s]))
    for s, msgs in convs.items():
        new = _layout(msgs + [{"role": "user", "content": "go on"}])
        steps.clear()
        assert index.candidates(SCOPE, new.body, new.start, 10_000) == [s]
        assert len(steps) == 3, (s, len(steps))
