"""The messages a conversation's last request converted to, so its next request converts only
what it adds.

An agent resends its whole history every turn: at 200 messages, checking their nesting and
converting each one to ``Message``s cost more than everything else a turn does, and it grew
with every turn. A request whose first items (chat or Anthropic messages, Responses input
items) equal, as parsed JSON, the first items of the conversation's previous request reuses
what they became; the comparison runs in C (dicts and strings compared by value), so a reuse
is never a guess and costs a fraction of a conversion. ``==`` equates ``1``, ``1.0`` and
``True``, which convert differently (tool-call arguments are written out as JSON): an item
holding a number or a boolean is also compared as JSON bytes. The comparison finds the
longest equal prefix, since clients move per-message markers (Anthropic's ``cache_control``)
to the newest messages.

Items whose conversion depends on more than themselves and the items before them are never
kept: content parts that may hold images (resolved per request). Responses API items merge
(a reasoning item, an assistant message and the function calls after them are one assistant
message): their converter says where a conversion may restart (no message half built), and a
reuse stops at the last such item.

Conversations are told apart by the session header when there is one (``X-Session-Id``,
Codex's ``session-id``, Claude Code's ``X-Claude-Code-Session-Id``), else by the start of
their first three items (a group's sessions share a system prompt and task, and part at the
first answer); two that look alike only take turns missing. Memory is bounded by an estimate
of what an entry holds (its request's bytes and ``ITEM_BYTES`` an item), least recently used
dropped first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from itertools import chain
from typing import Any, Callable, NamedTuple, Protocol, Sequence

import orjson

from tokenization.conversation import Message

from ..session.planner import message_chars
from .content import name_tool_messages
from .jsonio import check_body_depth, parse_json_object
from .resent_bytes import MIN_BYTES, WINDOW, Layout, extend_ends, field_start, layout_of, parse_after, shared_items
from .resent_index import LayoutIndex

ConvertItem = Callable[[int, Any], tuple[Sequence[Message], Sequence[str]]]


class MergingConverter(Protocol):
    """A converter whose items merge into messages (the Responses API): each call returns the
    messages the item completed; ``finish`` the one still being built after the last item."""

    def __call__(self, i: int, item: Any) -> tuple[Sequence[Message], Sequence[str]]: ...

    def at_start(self) -> bool:
        """No message half built: a conversion may restart at the next item."""
        ...

    def finish(self) -> Sequence[Message]: ...


@dataclass(frozen=True)
class Converted:
    """A request's leading items (as parsed) and what each became."""

    raw: list[Any]
    items: Sequence[tuple[Message, ...]]  # per item: its messages, tool messages named
    ids: Sequence[tuple[str, ...]]  # per item: the tool-call (and other Splice) ids it carries
    messages: Sequence[Message]  # all items' messages, in order
    flat_ids: Sequence[str]  # all items' ids, in order
    exact: dict[int, bytes]  # items holding numbers or booleans -> their JSON
    head: Any  # what precedes the items and must match too (the Anthropic system text)
    names: dict[str, str]  # tool-call id -> function name, after all items
    chars: tuple[int, int]  # ``message_chars`` of all items' messages
    cost: int
    starts: frozenset[int] | None = None  # items a conversion may restart at (None: every one)
    calls: int = 0  # tool calls in ``messages`` (``names`` has fewer keys when an id is used twice)
    layout: Layout | None = None  # where ``raw`` sits in the request's bytes (proxy/api/resent_bytes.py)


class Reuse(NamedTuple):
    entry: Converted
    n: int  # leading items reused


class Found(NamedTuple):
    """A request body's place in the memo: where its conversation is kept, what of it is reused."""

    key: tuple | None
    reuse: Reuse | None
    cost: int  # the request's bytes (keeping its conversion also counts ``ITEM_BYTES`` an item)
    layout: Layout | None = None  # where the request's items sit in its bytes, for the next request


class Conversion(NamedTuple):
    messages: list[Message]
    ids: list[str]
    items: list[tuple[Message, ...]]
    item_ids: list[tuple[str, ...]]
    names: dict[str, str]
    chars: tuple[int, int]  # (all, kept) characters of ``messages`` (``proxy.session.planner.message_chars``)
    starts: set[int] | None = None  # a merging converter's restart points (``MergingConverter.at_start``)
    calls: int = 0  # tool calls in ``messages``


def has_numbers(value: Any) -> bool:
    """Whether a JSON value holds a number or a boolean anywhere (``==`` is not exact there)."""
    stack = [value]
    while stack:
        v = stack.pop()
        t = type(v)
        if t is dict:
            stack.extend(v.values())
        elif t is list:
            stack.extend(v)
        elif t is not str and v is not None:
            return True
    return False


def _text_sig(content: Any) -> tuple:
    if type(content) is str:
        return (len(content), content[:64])
    if type(content) is not list:
        return (type(content).__name__,)
    out = []
    for b in content[:4]:
        if type(b) is not dict:
            out.append((type(b).__name__,))
            continue
        t = b.get("text")
        t = t if type(t) is str else b.get("thinking") if type(b.get("thinking")) is str else ""
        out.append((b.get("type"), b.get("id") or b.get("tool_use_id"), len(t), t[:64]))
    return tuple(out)


def _short(v: Any) -> Any:
    return (len(v), v[:64]) if type(v) is str else None


def _sig(m: Any) -> tuple:
    """Where conversations part: role, the start of the text, the first call's id, a Responses
    item's type, call id, arguments and output (bounded work)."""
    if type(m) is not dict:
        return (type(m).__name__,)
    calls = m.get("tool_calls")
    first = calls[0].get("id") if type(calls) is list and calls and type(calls[0]) is dict else None
    return (m.get("role"), _text_sig(m.get("content")), first, m.get("type"), _short(m.get("call_id")),
            _short(m.get("arguments")), _short(m.get("output")))  # fmt: skip


def convert(raw: list[Any], convert_item: ConvertItem | MergingConverter, reuse: Reuse | None) -> Conversion:
    """Convert ``raw`` item by item, starting after the reused ones; tool messages are named
    after the calls before them. A ``MergingConverter``'s items are given the messages they
    complete (the last item also the one it leaves unfinished).

    A reuse costs what the kept conversion had beyond it (a client that moves a marker to its
    newest message drops one item) plus what is added, never a walk of the whole history."""
    k = reuse.n if reuse is not None else 0
    merging = hasattr(convert_item, "finish")
    starts: set[int] | None = None
    if k:
        e = reuse.entry
        items, item_ids = list(e.items[:k]), list(e.ids[:k])
        dropped = list(chain.from_iterable(e.items[k:]))
        names, calls = dict(e.names), e.calls
        for m in dropped:
            for tc in m.tool_calls:
                names.pop(tc.id, None)
                calls -= 1
        if len(names) != calls:  # a call id used twice: the names as of item ``k``, from scratch
            names = {tc.id: tc.name for m in chain.from_iterable(items) for tc in m.tool_calls}
        base = e.messages[: len(e.messages) - len(dropped)] if dropped else e.messages
        n_ids = sum(map(len, e.ids[k:]))
        base_ids = e.flat_ids[: len(e.flat_ids) - n_ids] if n_ids else e.flat_ids
        d = message_chars(dropped)
        chars = (e.chars[0] - d[0], e.chars[1] - d[1])
        if merging:  # ``k`` is one of them (``match``)
            starts = set(e.starts) if e.starts is not None else set(range(k + 1))
            for s in range(k + 1, len(e.raw) + 1):
                starts.discard(s)
    else:
        items, item_ids, names, calls, base, base_ids, chars = [], [], {}, 0, (), (), (0, 0)
        starts = set() if merging else None
    for i in range(k, len(raw)):
        if merging and convert_item.at_start():
            starts.add(i)
        msgs, ids = convert_item(i, raw[i])
        items.append(tuple(name_tool_messages(list(msgs), names)))
        item_ids.append(tuple(ids))
    if merging:
        if convert_item.at_start():
            starts.add(len(raw))
        elif tail := convert_item.finish():
            items[-1] = (*items[-1], *name_tool_messages(list(tail), names))
    added = list(chain.from_iterable(items[k:]))
    a = message_chars(added)
    return Conversion([*base, *added], [*base_ids, *chain.from_iterable(item_ids[k:])], items, item_ids, names,
                      (chars[0] + a[0], chars[1] + a[1]), starts, calls + sum(len(m.tool_calls) for m in added))  # fmt: skip


# What an item held costs beyond its JSON: its parsed dicts and lists, the ``Message`` objects it
# converted to, the tuples holding them. Measured with tracemalloc on 300-item tool loops: about
# 900 bytes a chat message, 800 a Responses item, 1,150 an Anthropic message (content blocks).
ITEM_BYTES = 1536
# Kept requests a long request is compared with before it is parsed, newest first: those
# sharing its first bytes (an agent's system prompt) and, where they have them, its second and
# third items' (looked up: proxy/api/resent_index.py). Each costs a look at the start of its
# second item and at the third item's bytes (a microsecond or two) before the prefix search.
CANDIDATES = 256


class HistoryMemo:
    def __init__(self, *, min_messages: int = 8, max_bytes: int = 64 << 20, max_entries: int = 16384, min_bytes: int = MIN_BYTES):
        self.min_messages = min_messages
        self.min_bytes = min_bytes  # requests this long are parsed from what they add (``resent``)
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._kept: OrderedDict[tuple, Converted] = OrderedDict()
        self._layouts = LayoutIndex()  # kept requests' layouts, found by their first bytes
        self._bytes = 0
        self._lock = threading.Lock()
        self.reused = 0  # requests that reused a kept prefix (a count for tests and benches)
        self.resent_parsed = 0  # requests parsed from the bytes they add (``resent``)

    def key(self, dialect: str, raw: Any, session_id: str | None, size: int = 0) -> tuple | None:
        """Where a conversation's conversion is kept (None: too short to be worth keeping: fewer
        than ``min_messages`` items, or than 3 in a request of ``min_bytes`` or more).
        Dialects convert equal JSON differently, so each has its own keys."""
        if type(raw) is not list or len(raw) < (3 if size >= self.min_bytes else self.min_messages):
            return None
        return (dialect, session_id, _sig(raw[0]), _sig(raw[1]), _sig(raw[2]))

    def resent(self, raw: bytes, start: int, dialect: str, session_id: str | None, field: str) -> tuple[dict[str, Any], Layout] | None:
        """``raw`` parsed from what it adds to a kept request of its conversation (the body and
        its layout; the items it repeats byte for byte are the kept objects), or None: parse it
        in full. ``start``: ``field_start(raw, field)``."""
        with self._lock:
            keys = self._layouts.candidates((dialect, session_id), raw, start, CANDIDATES)
        for key in keys:
            hit = self._kept.get(key)
            if hit is None or hit.layout is None:
                continue
            old = hit.layout
            if not all(raw[e + 1 : e + 1 + WINDOW] == old.body[e + 1 : e + 1 + WINDOW] for e in old.ends[:2]):
                continue  # another conversation (another task, another first answer): a cheap look first
            if len(old.ends) > 2 and not raw.startswith(memoryview(old.body)[old.ends[1] + 1 : old.ends[2] + 1], old.ends[1] + 1):
                continue  # the third item differs where it sits: a group's sessions part at their first answer
            k = shared_items(raw, old)
            if k < min(3, len(old.ends)):
                continue  # not the same first items: another conversation
            body = parse_after(raw, old, k, field)
            if body is None:
                return None
            items = body[field]
            items[:0] = hit.raw[:k]  # the kept objects: equal to what parsing their bytes gives
            self.resent_parsed += 1
            return body, Layout(raw, old.start, extend_ends(raw, old.start, old.ends[:k], items))
        return None

    def match(self, key: tuple | None, raw: list[Any], head: Any = None) -> Reuse | None:
        """The kept conversion and how many of ``raw``'s first items equal its items, or None."""
        if key is None:
            return None
        with self._lock:
            hit = self._kept.get(key)
        if hit is None or type(hit.head) is not type(head) or hit.head != head:
            return None
        kept = hit.raw
        n = min(len(kept), len(raw))
        if raw[:n] != kept[:n]:  # one C-level comparison in the usual case; else the first difference
            if n > 1 and raw[: n - 1] == kept[: n - 1]:  # a marker moved off the last kept item
                n -= 1
            else:
                n = next(i for i in range(n) if raw[i] != kept[i])
        for i, exact in hit.exact.items():
            if i < n and raw[i] is not kept[i] and orjson.dumps(raw[i]) != exact:  # ``resent`` hands the kept ones
                n = i
        if hit.starts is not None:  # back to where no message is half built
            while n and n not in hit.starts:
                n -= 1
        if not n:
            return None
        self.reused += 1
        return Reuse(hit, n)

    def keep(self, key: tuple | None, raw: list[Any], head: Any, conv: Conversion, reuse: Reuse | None, cost: int,
             keepable: Callable[[Any], bool], layout: Layout | None = None) -> None:  # fmt: skip
        """Keep ``conv`` for the conversation's next request, up to its first item ``keepable``
        refuses. ``cost``: the request's bytes; an entry counts them plus ``ITEM_BYTES`` an item.
        ``layout``: where ``raw`` sits in the request's bytes (``Found.layout``)."""
        cost += ITEM_BYTES * len(raw)
        if key is None or cost > self.max_bytes:
            return
        k = reuse.n if reuse is not None else 0
        exact = dict(reuse.entry.exact) if reuse is not None else {}
        if exact:  # indices ascend: drop those of the items not reused, from the end
            at = list(exact)
            while at and at[-1] >= k:
                del exact[at.pop()]
        end = len(raw)
        for i in range(k, len(raw)):
            item = raw[i]
            if not keepable(item):
                end = i
                break
            if has_numbers(item):
                exact[i] = bytes(memoryview(orjson.dumps(item)))  # orjson's own bytes keep a 4 KB buffer
        if end == 0:
            return
        starts = frozenset(s for s in conv.starts if s <= end) if conv.starts is not None else None
        if layout is not None:
            layout = Layout(layout.body, layout.start, layout.ends[:end]) if len(layout.ends) > end else layout
        if end == len(raw):  # copies of references (the request goes on to use its lists)
            entry = Converted(raw, tuple(conv.items), tuple(conv.item_ids), tuple(conv.messages), tuple(conv.ids), exact, head,
                              conv.names, conv.chars, cost, starts, conv.calls, layout)  # fmt: skip
        else:
            items = conv.items[:end]
            messages = list(chain.from_iterable(items))
            names = {tc.id: tc.name for m in messages for tc in m.tool_calls}
            entry = Converted(raw[:end], items, conv.item_ids[:end], messages, list(chain.from_iterable(conv.item_ids[:end])),
                              exact, head, names, message_chars(messages), cost, starts,
                              sum(len(m.tool_calls) for m in messages), layout)  # fmt: skip
        with self._lock:
            old = self._kept.pop(key, None)
            if old is not None:
                self._bytes -= old.cost
                self._unindex(key, old)
            self._kept[key] = entry
            self._bytes += entry.cost
            if layout is not None:
                self._layouts.add(key[:2], key, layout)
            while (self._bytes > self.max_bytes or len(self._kept) > self.max_entries) and self._kept:
                gone, dropped = self._kept.popitem(last=False)
                self._bytes -= dropped.cost
                self._unindex(gone, dropped)

    def _unindex(self, key: tuple, entry: Converted) -> None:
        if entry.layout is not None:
            self._layouts.remove(key[:2], key, entry.layout)


NOT_KEPT = object()  # what ``read_body``'s ``head`` returns for a request whose conversation is not kept


def read_body(raw: bytes, memo: HistoryMemo, dialect: str, session_id: str | None,
              head: Callable[[dict], Any] = lambda body: None, field: str = "messages") -> tuple[dict[str, Any], Found]:  # fmt: skip
    """A turn request's JSON object, its nesting checked except in the items (``body[field]``)
    ``memo`` already holds, and what of its conversation ``memo`` holds. ``head(body)``: what
    precedes the items and must match too (None: the conversation is not kept).

    A long request that repeats the bytes of its conversation's last request is parsed from
    what it adds (proxy/api/resent_bytes.py)."""
    start = field_start(raw, field) if len(raw) >= memo.min_bytes else -1
    resent = memo.resent(raw, start, dialect, session_id, field) if start >= 0 else None
    body, layout = resent if resent is not None else (parse_json_object(raw), None)
    msgs = body.get(field)
    h = head(body)
    key = memo.key(dialect, msgs, session_id, len(raw)) if h is not NOT_KEPT else None
    reuse = memo.match(key, msgs, h) if key is not None else None
    check_body_depth(raw, body, items=field, checked=reuse.n if reuse is not None else 0)
    if layout is None and key is not None and start >= 0:
        layout = layout_of(raw, body, field, start, msgs)
    return body, Found(key, reuse, len(raw), layout)
