"""Which kept conversations a long request may repeat, found without looking at every one.

Header-less sessions that share a system prompt share the first bytes of their requests, so
``HistoryMemo`` keeps them in one bucket (``WINDOW`` bytes after the items' ``[``). Comparing
a request with each of them costs about 1.3 us a look-alike: 180 us a turn with 256 such
sessions in flight, and its own conversation may be older than the 256 newest. Those sessions
part at their second or third item (the task, the first answer), and ``HistoryMemo.resent``
compares those items anyway, so the bucket indexes each conversation by them:

- by where its second item ends and the ``WINDOW`` bytes after it (the third item's start:
  sampled answers part there);
- then by where its third item ends and a hash of that item's bytes (answers that start alike,
  a tool call whose id is time-ordered, part further on).

A request looks up its own bytes once for each such end in the bucket: one per task, then one
per length of the first answers that start alike. Only the conversations found are compared in
full, newest first; a hash that collides only adds one to compare.
"""

from __future__ import annotations

from collections.abc import Hashable
from operator import itemgetter

from .resent_bytes import WINDOW, Layout


class _Third:
    """The conversations of a bucket whose third item starts alike."""

    __slots__ = ("by_item", "ends", "two")

    def __init__(self) -> None:
        self.by_item: dict[tuple[int, int], dict[Hashable, int]] = {}  # (its end, hash of its bytes) -> {key: when kept}
        self.ends: dict[int, int] = {}  # end of the third item -> conversations kept with it
        self.two: dict[Hashable, int] = {}  # layouts of two items: no third to tell apart


class _Bucket:
    __slots__ = ("by_start", "ends", "short", "size")

    def __init__(self) -> None:
        self.by_start: dict[tuple[int, bytes], _Third] = {}  # (end of the second item, WINDOW bytes after it)
        self.ends: dict[int, int] = {}  # end of the second item -> conversations kept with it
        self.short: dict[Hashable, int] = {}  # layouts of fewer than two items: compared each time
        self.size = 0


def _count(ends: dict[int, int], e: int, by: int) -> None:
    n = ends.get(e, 0) + by
    if n:
        ends[e] = n
    else:
        del ends[e]


class LayoutIndex:
    """Kept layouts by their first bytes, then by their second and third items. Not
    thread-safe: ``HistoryMemo`` calls it under its lock."""

    def __init__(self) -> None:
        self._buckets: dict[tuple, _Bucket] = {}
        self._tick = 0

    @staticmethod
    def _bucket_key(scope: tuple, body: bytes, start: int) -> tuple:
        return (*scope, body[start + 1 : start + 1 + WINDOW])

    def add(self, scope: tuple, key: Hashable, layout: Layout) -> None:
        """Index ``key``'s layout (``scope``: what else tells conversations apart, e.g. the
        dialect and session). A key is added once; ``remove`` it before adding it again."""
        self._tick += 1
        body, ends = layout.body, layout.ends
        b = self._buckets.setdefault(self._bucket_key(scope, body, layout.start), _Bucket())
        b.size += 1
        if len(ends) < 2:
            b.short[key] = self._tick
            return
        e1 = ends[1]
        third = b.by_start.get(start := (e1, body[e1 + 1 : e1 + 1 + WINDOW]))
        if third is None:
            third = b.by_start[start] = _Third()
        _count(b.ends, e1, 1)
        if len(ends) == 2:
            third.two[key] = self._tick
            return
        e2 = ends[2]
        third.by_item.setdefault((e2, hash(body[e1 + 1 : e2 + 1])), {})[key] = self._tick
        _count(third.ends, e2, 1)

    def remove(self, scope: tuple, key: Hashable, layout: Layout) -> None:
        body, ends = layout.body, layout.ends
        bkey = self._bucket_key(scope, body, layout.start)
        b = self._buckets.get(bkey)
        if b is None:
            return
        if len(ends) < 2:
            if b.short.pop(key, None) is None:
                return
        else:
            e1 = ends[1]
            start = (e1, body[e1 + 1 : e1 + 1 + WINDOW])
            third = b.by_start.get(start)
            if third is None:
                return
            if len(ends) == 2:
                if third.two.pop(key, None) is None:
                    return
            else:
                e2 = ends[2]
                item = (e2, hash(body[e1 + 1 : e2 + 1]))
                keys = third.by_item.get(item)
                if keys is None or keys.pop(key, None) is None:
                    return
                if not keys:
                    del third.by_item[item]
                _count(third.ends, e2, -1)
            if not third.two and not third.by_item:
                del b.by_start[start]
            _count(b.ends, e1, -1)
        b.size -= 1
        if not b.size:
            del self._buckets[bkey]

    def candidates(self, scope: tuple, raw: bytes, start: int, limit: int) -> list[Hashable]:
        """Keys whose layout ``raw`` may repeat (the same first bytes, and the same second and
        third items where they have them), most recently kept first, at most ``limit``."""
        b = self._buckets.get(self._bucket_key(scope, raw, start))
        if b is None:
            return []
        found: list[tuple[Hashable, int]] = []
        for e1 in b.ends:
            third = b.by_start.get((e1, raw[e1 + 1 : e1 + 1 + WINDOW]))
            if third is None:
                continue
            found.extend(third.two.items())
            for e2 in third.ends:
                keys = third.by_item.get((e2, hash(raw[e1 + 1 : e2 + 1])))
                if keys:
                    found.extend(keys.items())
        found.extend(b.short.items())
        if len(found) > 1:
            found.sort(key=itemgetter(1), reverse=True)
        return [k for k, _ in found[:limit]]
