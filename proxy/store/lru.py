"""A size-bounded LRU for decoded token sequences and conversations, safe across threads."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Hashable


class LRU:
    """Values by key, evicting the least recently used once their total ``len`` passes ``budget``.

    ``sized=False`` counts entries instead of ``len(value)`` (for small flags)."""

    def __init__(self, budget: int, *, sized: bool = True):
        self.budget, self.used, self.sized = budget, 0, sized
        self._items: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()

    def _size(self, value: Any) -> int:
        return len(value) if self.sized else 1

    def get(self, key: Hashable) -> Any:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: Hashable, value: Any) -> None:
        size = self._size(value)
        with self._lock:
            if size > self.budget or key in self._items:
                return
            self._items[key] = value
            self.used += size
            while self.used > self.budget:
                _, old = self._items.popitem(last=False)
                self.used -= self._size(old)

    def __len__(self) -> int:
        return len(self._items)
