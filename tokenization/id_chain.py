"""Token ids that grow by appending, shared along a session instead of copied each turn.

A spliced turn's prompt is its parent's prompt and output plus the bridge ids, and that prompt
plus its own output is where the next turn starts. Built with ``np.concatenate``, a session of
100k tokens copied its whole history twice a turn (the prompt, then prompt + output for the
store's cache) and compared it twice (the store's prompt base, the engine client's kept JSON).

``join(*parts)`` gives the parts as one read-only int32 array. Its result is a view of a chain
buffer: ids written once, never written again, with spare room after them. When the leading
parts already are a buffer's whole written content, the rest is written into the spare room and
the result is a longer view of the same buffer, so nothing before them is copied. A second
child of the same parent finds the buffer already written past its head and gets a copy (a new
buffer). Because written ids never change, two views from the start of one buffer agree on
their common length: ``known_prefix`` answers in O(1) what a compare answers in O(n).
"""

from __future__ import annotations

import threading
import weakref

import numpy as np

I32 = np.dtype(np.int32)

_lock = threading.Lock()
_written: dict[int, int] = {}  # id(buffer) -> ids written into it; the rest of it is spare room


def _new_buffer(n: int) -> np.ndarray:
    """A buffer for ``n`` ids and a quarter more (a long session reallocates rarely)."""
    buf = np.empty(n + n // 4 + 64, dtype=I32)
    key = id(buf)
    _written[key] = 0
    weakref.finalize(buf, _written.pop, key, None)  # runs before the id can name another object
    return buf


def _view(buf: np.ndarray, n: int) -> np.ndarray:
    out = buf[:n]
    out.flags.writeable = False
    return out


def _chain_start(a: np.ndarray) -> np.ndarray | None:
    """The chain buffer ``a`` is a view of from its first id, or None."""
    buf = a.base
    if buf is None or id(buf) not in _written or a.dtype != I32 or not a.flags.c_contiguous:
        return None
    return buf if a.ctypes.data == buf.ctypes.data else None


def join(*parts) -> np.ndarray:
    """``parts`` (arrays or lists of ids) as one read-only int32 array, without copying a
    leading run of parts that already ends a chain buffer's written ids."""
    arrays = [p if isinstance(p, np.ndarray) and p.dtype == I32 else np.asarray(p, dtype=I32) for p in parts]
    total = sum(a.size for a in arrays)
    head = arrays[0] if arrays else None
    buf = _chain_start(head) if head is not None else None
    if buf is not None:
        n, k = head.size, 1
        # later parts that continue the head in the same buffer (a parent's prompt, then its output)
        while k < len(arrays) and arrays[k].base is buf and arrays[k].flags.c_contiguous and \
                arrays[k].ctypes.data == buf.ctypes.data + n * I32.itemsize:  # fmt: skip
            n += arrays[k].size
            k += 1
        with _lock:
            fits = _written.get(id(buf)) == n and total <= buf.size
            if fits:
                _written[id(buf)] = total
        if fits:  # [n, total) is this call's alone now: nobody else writes there or reads it yet
            for a in arrays[k:]:
                buf[n : n + a.size] = a
                n += a.size
            return _view(buf, total)
    buf = _new_buffer(total)
    n = 0
    for a in arrays:
        buf[n : n + a.size] = a
        n += a.size
    _written[id(buf)] = total
    return _view(buf, total)


def known_prefix(a: np.ndarray, b: np.ndarray) -> bool:
    """True when ``a`` is known, without comparing, to be a prefix of ``b``: both are views from
    the start of one chain buffer (whose ids never change) and ``a`` is not longer. False says
    nothing: compare them."""
    if not isinstance(a, np.ndarray) or not isinstance(b, np.ndarray) or a.size > b.size:
        return False
    buf = _chain_start(a)
    return buf is not None and b.base is buf and b.dtype == I32 and b.flags.c_contiguous and b.ctypes.data == buf.ctypes.data


def is_chain(a) -> bool:
    """Whether ``a`` is a view from the start of a chain buffer (its ids never change)."""
    return isinstance(a, np.ndarray) and _chain_start(a) is not None


def held_memory(a: np.ndarray) -> tuple[int, int]:
    """``(key, bytes)`` of the memory ``a`` lives in: the buffer it views (one chain buffer holds
    every turn of a session), else ``a`` itself. The key is valid while ``a`` is alive."""
    owner = a.base if isinstance(a.base, np.ndarray) else a
    return id(owner), owner.nbytes
