"""A size-bounded LRU for decoded token sequences and conversations, safe across threads."""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from typing import Any, Callable, Hashable


# What one cached entry costs beyond its value: the OrderedDict's hash slot and link node and
# the key object (measured on CPython 3.11: about 100-130 bytes for an int key).
ENTRY_BYTES = 128
# An entry of an LRU with ``shared``: its slot and the value's own object (a numpy view's is 112
# bytes); the memory it views is counted once for all entries sharing it.
SHARED_ENTRY_BYTES = 2 * ENTRY_BYTES


def memory_of(value: Any) -> int:
    """Bytes a cached ``bytes`` value really holds: the object itself and its entry."""
    return sys.getsizeof(value) + ENTRY_BYTES


class LRU:
    """Values by key, evicting the least recently used once their total size passes ``budget``.

    Size is ``len(value)`` by default, ``weigh(value)`` when given (``memory_of``: bytes held),
    and 1 per entry with ``sized=False`` (for small flags). ``shared(value)`` gives the memory a
    value lives in as ``(key, bytes)``: values that share it (views of one buffer, such as a
    session's turns in an id chain) count it once, until the last of them leaves; each entry
    adds ``SHARED_ENTRY_BYTES``."""

    def __init__(
        self,
        budget: int,
        *,
        sized: bool = True,
        weigh: Callable[[Any], int] | None = None,
        shared: Callable[[Any], tuple[Hashable, int]] | None = None,
    ):
        self.budget, self.used, self.sized = budget, 0, sized
        self.weigh = weigh
        self.shared = shared
        self._holders: dict[Hashable, list[int]] = {}  # with ``shared``: memory key -> [entries, bytes]
        self._items: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()

    def _size(self, value: Any) -> int:
        if self.weigh is not None:
            return self.weigh(value)
        return len(value) if self.sized else 1

    def get(self, key: Hashable) -> Any:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: Hashable, value: Any) -> None:
        if self.shared is not None:
            self._put_shared(key, value)
            return
        size = self._size(value)
        with self._lock:
            if size > self.budget or key in self._items:
                return
            self._items[key] = value
            self.used += size
            while self.used > self.budget:
                _, old = self._items.popitem(last=False)
                self.used -= self._size(old)

    def _put_shared(self, key: Hashable, value: Any) -> None:
        mem, size = self.shared(value)
        with self._lock:
            if size > self.budget or key in self._items:
                return
            self._items[key] = value
            self.used += SHARED_ENTRY_BYTES
            held = self._holders.get(mem)
            if held is None:
                self._holders[mem] = [1, size]
                self.used += size
            else:
                held[0] += 1
            while self.used > self.budget:
                self._release(self._items.popitem(last=False)[1])

    def _release(self, value: Any) -> None:
        """(With ``shared``, under the lock.) One entry fewer on ``value``'s memory."""
        self.used -= SHARED_ENTRY_BYTES
        mem = self.shared(value)[0]
        held = self._holders[mem]
        held[0] -= 1
        if not held[0]:
            del self._holders[mem]
            self.used -= held[1]

    def pop(self, key: Hashable) -> None:
        """Forget ``key`` (a no-op when absent)."""
        with self._lock:
            value = self._items.pop(key, None)
            if value is not None:
                if self.shared is not None:
                    self._release(value)
                else:
                    self.used -= self._size(value)

    def __len__(self) -> int:
        return len(self._items)
