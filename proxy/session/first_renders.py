"""The prompt ids of recent first turns, for requests that start the same conversation again.

The sessions of a GRPO group, and agents given the same task, open with the same messages,
tools and chat-template arguments; each first turn is a full render of the chat template (about
0.2-0.4 ms for a short task, tens of ms for a long one). A first turn equal to a recent one in
every field (``Message`` and ``Tool`` are frozen dataclasses: equality compares every field,
strings in C) reuses its ids. Found by a cheap key (message count, characters, the start of the
last message), then compared in full, so a reuse is never a guess. Requests with images are
rendered every time (their pads are placed per request). Bounded by the characters of the
messages kept, plus ``ENTRY_CHARS`` an entry (``proxy/store/lru.py``: thread-safe, since a long
request is planned in a worker thread).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from tokenization import Message
from tokenization.conversation import Tool, message_images

from ..store.lru import LRU


# What an entry costs beyond its messages' characters (its tuples, ids and slot), so that many
# short first turns are bounded too: 32M characters hold at most 8,192 entries.
ENTRY_CHARS = 4096


class FirstRenders:
    def __init__(self, *, max_chars: int = 32 << 20):
        self._kept = LRU(max_chars, weigh=lambda entry: entry[4] + ENTRY_CHARS)
        self.reused = 0  # first turns that reused a kept render (``splice_render_reused_total``)

    @staticmethod
    def _key(messages: Sequence[Message], chars: int) -> tuple:
        last = messages[-1].content if messages else ""
        return (len(messages), chars, last[:64] if isinstance(last, str) else None)

    def get(self, messages: Sequence[Message], tools: Sequence[Tool], kwargs: dict | None, chars: int) -> np.ndarray | None:
        """The kept ids (read-only int32) of a render of exactly these inputs, or None."""
        hit = self._kept.get(self._key(messages, chars))
        if hit is None:
            return None
        msgs, kept_tools, kept_kwargs, ids, _ = hit
        if len(msgs) != len(messages) or any(a != b for a, b in zip(msgs, messages)):
            return None
        if tuple(tools) != kept_tools or (kept_kwargs or {}) != (kwargs or {}):
            return None
        self.reused += 1  # a count for tests and benches (the metric is the runner's)
        return ids

    def put(self, messages: Sequence[Message], tools: Sequence[Tool], kwargs: dict | None, chars: int, ids: Any) -> np.ndarray:
        """Keep a render's ids; returns them as the read-only int32 array kept."""
        arr = np.array(ids, dtype=np.int32)
        arr.flags.writeable = False
        if message_images(messages):
            return arr
        key = self._key(messages, chars)
        self._kept.pop(key)  # a newer render under the same key replaces the older
        self._kept.put(key, (tuple(messages), tuple(tools), dict(kwargs) if kwargs else None, arr, chars))
        return arr
