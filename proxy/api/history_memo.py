"""The messages a conversation's last request converted to, so its next request converts only
what it adds.

An agent resends its whole history every turn: at 200 messages, checking their nesting and
converting each one to a ``Message`` cost more than everything else a turn does, and it grew
with every turn. A request whose first messages equal, as parsed JSON, the messages of a
conversation's previous request reuses what they became. The comparison is one C-level
``==`` of the two lists (dicts and strings compared by value), so a reuse is never a guess,
and it costs a fraction of converting them.

Only plain messages are kept: string (or absent) content, no image or other content parts
(an image part is resolved per request). Conversations are told apart by the session header
when there is one, else by the start of their first three messages (a group's sessions share
a system prompt and task, and part at the first answer); two that look alike only take turns
missing. Memory is bounded by the request bytes kept, least recently used dropped first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from tokenization.conversation import Message


@dataclass(frozen=True)
class Converted:
    """A request's plain leading messages (as parsed) and what they converted to."""

    raw: list[dict[str, Any]]
    messages: tuple[Message, ...]
    ids: tuple[str, ...]  # the tool-call ids they carry, in order
    names: dict[str, str]  # tool-call id -> function name (for the tool messages after them)
    cost: int


def plain(m: Any) -> bool:
    """A message whose conversion depends on nothing but itself and the messages before it, and
    on no value that ``==`` equates with a different one (``1 == 1.0 == True``): string content,
    tool-call arguments as strings (an object would be written out as JSON)."""
    if type(m) is not dict:
        return False
    content = m.get("content")
    if content is not None and type(content) is not str:
        return False
    calls = m.get("tool_calls")
    if calls is None:
        return True
    return type(calls) is list and all(
        type(tc) is dict and type(fn := tc.get("function")) is dict and type(fn.get("arguments", "")) is str for tc in calls
    )


def _sig(m: Any) -> tuple:
    if type(m) is not dict:
        return (None,)
    content = m.get("content")
    text = content[:64] if type(content) is str else None
    calls = m.get("tool_calls")
    first = repr(calls[0])[:128] if type(calls) is list and calls else None
    return (m.get("role"), len(content) if type(content) is str else -1, text, first)


class HistoryMemo:
    def __init__(self, *, min_messages: int = 8, max_bytes: int = 64 << 20, max_entries: int = 16384):
        self.min_messages = min_messages
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._kept: OrderedDict[tuple, Converted] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.reused = 0  # requests that reused a kept prefix (a count for tests and benches)

    def key(self, raw: list[Any], session_id: str | None) -> tuple | None:
        if len(raw) < self.min_messages:
            return None
        return (session_id, _sig(raw[0]), _sig(raw[1]), _sig(raw[2]))

    def match(self, key: tuple | None, raw: list[Any]) -> Converted | None:
        """The kept conversion whose raw messages are exactly ``raw``'s first ones, else None."""
        if key is None:
            return None
        with self._lock:
            hit = self._kept.get(key)
        if hit is None or len(hit.raw) > len(raw) or raw[: len(hit.raw)] != hit.raw:
            return None
        self.reused += 1
        return hit

    def keep(self, key: tuple | None, entry: Converted) -> None:
        if key is None or entry.cost > self.max_bytes:
            return
        with self._lock:
            old = self._kept.pop(key, None)
            if old is not None:
                self._bytes -= old.cost
            self._kept[key] = entry
            self._bytes += entry.cost
            while (self._bytes > self.max_bytes or len(self._kept) > self.max_entries) and self._kept:
                self._bytes -= self._kept.popitem(last=False)[1].cost
