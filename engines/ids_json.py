"""A long prompt's ids as JSON, written once per session rather than once per turn.

Each turn of a session sends the whole conversation's ids to the engine, and each prompt starts
with the previous one (a splice appends the last output and the new messages). Writing 100k ids
as JSON costs about 0.5 ms here, every turn; appending the new tail to the previous turn's JSON
costs a copy of the bytes. The request body carries the result as an ``orjson.Fragment``.

Every reuse is checked: the previous ids (a private copy) must equal the new prompt's prefix,
else the ids are written in full. Short prompts and calls without a session key are written
as they are. Memory is bounded (ids plus JSON bytes, least recently used dropped first).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import orjson

from engines.http import token_list

_NUMPY = orjson.OPT_SERIALIZE_NUMPY


class IdsJson:
    def __init__(self, *, min_ids: int = 4096, max_bytes: int = 32 << 20):
        self.min_ids = min_ids
        self.max_bytes = max_bytes
        self._last: OrderedDict[str, tuple[np.ndarray, bytes]] = OrderedDict()
        self._bytes = 0
        self.reused = 0  # prompts written by appending (a count for tests and benches)

    def __call__(self, key: str | None, ids: Any) -> Any:
        """What a request body carries for ``ids`` (an ``orjson.Fragment`` or ``token_list(ids)``)."""
        if not key or not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.dtype.kind != "i" or ids.size < self.min_ids:
            return token_list(ids)
        text = None
        hit = self._last.pop(key, None)
        if hit is not None:
            prev, prev_text = hit
            self._bytes -= prev.nbytes + len(prev_text)
            n = prev.size
            if n <= ids.size and np.array_equal(prev, ids[:n]):
                tail = ids[n:]
                if tail.size:  # one copy of the long text: ``a[:-1] + b"," + c`` made three (~1 ms at 100k ids)
                    tail_text = orjson.dumps(tail, option=_NUMPY)
                    text = b"".join((memoryview(prev_text)[:-1], b",", memoryview(tail_text)[1:]))
                else:
                    text = prev_text
                self.reused += 1
        if text is None:  # kept at its size: orjson's bytes hold up to 3 times their length
            text = bytes(memoryview(orjson.dumps(ids, option=_NUMPY)))
        own = ids.copy()  # the caller's array may change later; the check compares against this copy
        self._last[key] = (own, text)
        self._bytes += own.nbytes + len(text)
        while self._bytes > self.max_bytes and self._last:
            old, old_text = self._last.popitem(last=False)[1]
            self._bytes -= old.nbytes + len(old_text)
        return orjson.Fragment(text)
