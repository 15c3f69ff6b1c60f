"""The prompt ids of recent first turns, for requests that start the same conversation again.

The sessions of a GRPO group, and agents given the same task, open with the same messages,
tools and chat-template arguments; each first turn is a full render of the chat template (about
0.2-0.4 ms for a short task, tens of ms for a long one). A first turn equal to a recent one in
every field (``Message`` and ``Tool`` are frozen dataclasses: equality compares every field,
strings in C) reuses its ids. Found by a cheap key (message count, characters, the start of the
last message), then compared in full, so a reuse is never a guess. Requests with images are
rendered every time (their pads are placed per request). Bounded by entries and by the
characters of the messages kept; thread-safe, since a long request is planned in a worker thread.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Sequence

import numpy as np

from tokenization import Message
from tokenization.conversation import Tool, message_images


class FirstRenders:
    def __init__(self, *, max_entries: int = 256, max_chars: int = 32 << 20):
        self.max_entries, self.max_chars = max_entries, max_chars
        self._kept: OrderedDict[tuple, tuple[tuple[Message, ...], tuple[Tool, ...], dict | None, np.ndarray, int]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()
        self.reused = 0  # first turns that reused a kept render (``splice_render_reused_total``)

    @staticmethod
    def _key(messages: Sequence[Message], chars: int) -> tuple:
        last = messages[-1].content if messages else ""
        return (len(messages), chars, last[:64] if isinstance(last, str) else None)

    def get(self, messages: Sequence[Message], tools: Sequence[Tool], kwargs: dict | None, chars: int) -> np.ndarray | None:
        """The kept ids (read-only int32) of a render of exactly these inputs, or None."""
        key = self._key(messages, chars)
        with self._lock:
            hit = self._kept.get(key)
            if hit is None:
                return None
            self._kept.move_to_end(key)
        msgs, kept_tools, kept_kwargs, ids, _ = hit
        if len(msgs) != len(messages) or any(a != b for a, b in zip(msgs, messages)):
            return None
        if tuple(tools) != kept_tools or (kept_kwargs or {}) != (kwargs or {}):
            return None
        with self._lock:
            self.reused += 1
        return ids

    def put(self, messages: Sequence[Message], tools: Sequence[Tool], kwargs: dict | None, chars: int, ids: Any) -> np.ndarray:
        """Keep a render's ids; returns them as the read-only int32 array kept."""
        arr = np.array(ids, dtype=np.int32)
        arr.flags.writeable = False
        if chars > self.max_chars or message_images(messages):
            return arr
        key = self._key(messages, chars)
        entry = (tuple(messages), tuple(tools), dict(kwargs) if kwargs else None, arr, chars)
        with self._lock:
            old = self._kept.pop(key, None)
            if old is not None:
                self._chars -= old[4]
            self._kept[key] = entry
            self._chars += chars
            while (self._chars > self.max_chars or len(self._kept) > self.max_entries) and self._kept:
                self._chars -= self._kept.popitem(last=False)[1][4]
        return arr
