"""A long prompt's ids as JSON, written once per session rather than once per turn.

Each turn of a session sends the whole conversation's ids to the engine, and each prompt starts
with the previous one (a splice appends the last output and the new messages). Writing 100k ids
as JSON costs about 0.5 ms here, every turn. Instead each session keeps its last prompt's JSON
text as pieces, and a turn that extends the prompt adds one piece for the new ids: the body goes
out as those pieces (``JsonPieces``, engines/json_body.py), with no copy of the long text.

Every reuse is checked: the previous ids must equal the new prompt's prefix, else the ids are
written in full. The proxy's prompts are views of id chains (tokenization/id_chain.py), whose
ids are never written twice: such a prompt is kept as it is, and one that starts where it did
is known to extend it without a compare. Other arrays are kept as a private copy, grown in place
like a list, and compared. Short prompts and calls without a session key are written as they
are. Memory is bounded (the JSON bytes, and the ids of private copies: a chain's ids are its
session's turns', counted by the store's cache; least recently used dropped first); a session's
pieces are joined into one when they pass ``MAX_PIECES``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import orjson

from engines.http import token_list
from engines.json_body import JsonPieces
from tokenization.id_chain import is_chain, known_prefix

_NUMPY = orjson.OPT_SERIALIZE_NUMPY
MAX_PIECES = 64  # a writev's buffers stay far below IOV_MAX (1024); joining costs one copy per 64 turns
_CLOSE = b"]"
# A 100k-token prompt's JSON takes about 650 KB (its ids, an id chain's, are the session's turns'):
# room for about 200 such sessions, as the proxy's other per-session caches hold about 150-250
# (proxy/api/history_memo.py, tokenization.HistoryHashes, the store's turn ids).
MAX_BYTES = 128 << 20


class _Kept:
    """One session's last prompt: its ids and its JSON text without the closing bracket, in
    pieces. The ids are the caller's own array when it is an id chain's (it cannot change),
    else a private copy (``buf[:n]``, spare room after)."""

    __slots__ = ("buf", "n", "pieces", "text_bytes", "ref")

    def __init__(self, ids: np.ndarray):
        self.n = 0
        self.ref: np.ndarray | None = None
        self.buf: np.ndarray | None = None
        self.keep(ids)
        # kept at its size: orjson's bytes hold up to 3 times their length
        self.pieces = [bytes(memoryview(orjson.dumps(ids, option=_NUMPY))[:-1])]
        self.text_bytes = len(self.pieces[0])

    @property
    def nbytes(self) -> int:
        """What this entry alone holds: an id chain's ids belong to the session's turns (the store's
        turn cache counts them), a private copy is this entry's."""
        return self.text_bytes if self.ref is not None else self.buf.nbytes + self.text_bytes

    def extends(self, ids: np.ndarray) -> bool:
        if self.ref is not None and known_prefix(self.ref, ids):
            return True
        kept = self.ref if self.ref is not None else self.buf[: self.n]
        return self.n <= ids.size and np.array_equal(kept, ids[: self.n])

    def keep(self, ids: np.ndarray) -> None:
        """Keep ``ids``, which start with the ids kept so far."""
        if is_chain(ids):
            self.ref, self.buf, self.n = ids, None, ids.size
            return
        if self.buf is None or self.buf.dtype != ids.dtype:  # (a copy of the whole, once)
            self.buf, self.n = np.empty(ids.size + ids.size // 4 + 64, dtype=ids.dtype), 0
        elif ids.size > self.buf.size:  # grown by a quarter: a long session copies its ids rarely
            buf = np.empty(ids.size + ids.size // 4 + 64, dtype=self.buf.dtype)
            buf[: self.n] = self.buf[: self.n]
            self.buf = buf
        self.buf[self.n : ids.size] = ids[self.n :]
        self.ref, self.n = None, ids.size

    def append(self, ids: np.ndarray) -> None:
        """The JSON for ``ids``, which extend the kept ones, by its new tail."""
        tail = ids[self.n :]
        self.keep(ids)
        piece = b"," + orjson.dumps(tail, option=_NUMPY)[1:-1]
        self.pieces.append(piece)
        self.text_bytes += len(piece)
        if len(self.pieces) > MAX_PIECES:
            self.pieces = [b"".join(self.pieces)]

    def json(self) -> JsonPieces:
        return JsonPieces((*self.pieces, _CLOSE))


class IdsJson:
    def __init__(self, *, min_ids: int = 4096, max_bytes: int = MAX_BYTES):
        self.min_ids = min_ids
        self.max_bytes = max_bytes
        self._last: OrderedDict[str, _Kept] = OrderedDict()
        self._bytes = 0
        self.reused = 0  # prompts written by appending (a count for tests and benches)

    def __call__(self, key: str | None, ids: Any) -> Any:
        """What a request body carries for ``ids`` (``JsonPieces`` or ``token_list(ids)``)."""
        if not key or not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.dtype.kind != "i" or ids.size < self.min_ids:
            return token_list(ids)
        kept = self._last.pop(key, None)
        if kept is not None:
            self._bytes -= kept.nbytes
            if kept.extends(ids):
                if ids.size > kept.n:
                    kept.append(ids)
                else:
                    kept.keep(ids)
                self.reused += 1
            else:
                kept = None
        if kept is None:
            kept = _Kept(ids)
        self._last[key] = kept
        self._bytes += kept.nbytes
        while self._bytes > self.max_bytes and self._last:
            self._bytes -= self._last.popitem(last=False)[1].nbytes
        return kept.json()
