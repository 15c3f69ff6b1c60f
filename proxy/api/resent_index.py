"""Which kept conversations a long request may repeat, found without looking at every one.

Header-less sessions that share a system prompt share the first bytes of their requests, so
``HistoryMemo`` keeps them in one bucket (``WINDOW`` bytes after the items' ``[``). Comparing
a request with each of them costs about 1.3 us a look-alike: 180 us a turn with 256 such
sessions in flight, and its own conversation may be older than the 256 newest. Those sessions
part at their second or third item (the task, the first answer), and ``HistoryMemo.resent``
compares those items anyway, so each bucket is a small tree over them:

- by where the first item ends and the ``WINDOW`` bytes after it (the task's start);
- then by where the second item ends and the ``WINDOW`` bytes after it (the first answer's
  start: sampled answers part there);
- then by where the third item ends and a hash of its bytes (answers that start alike, a tool
  call whose id is time-ordered, part further on).

A request follows its own bytes down the tree, one look-up for each distinct end below a node
it reaches (one system prompt, one task length, one answer length, as a rule). Only the
conversations found are compared in full, newest first; a hash that collides only adds one to
compare. A bucket of one or two conversations (a lone agent) is handed over whole.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from operator import itemgetter

from .resent_bytes import WINDOW, Layout


DEPTH = 3  # items a layout is indexed by: the bytes that tell look-alike sessions apart
# Buckets of this many layouts or fewer are handed over whole: comparing each costs less than
# the steps down the tree (a few microseconds of slicing and hashing).
FEW = 2


class _Node:
    __slots__ = ("children", "ends", "keys")

    def __init__(self) -> None:
        self.children: dict[tuple[int, Hashable], _Node] = {}  # (an item's end, what follows it) -> node
        self.ends: dict[int, int] = {}  # the ends in ``children`` -> how many children have each
        self.keys: dict[Hashable, int] = {}  # layouts indexed down to here -> when kept


def _edge(body: bytes, ends: Sequence[int], depth: int) -> tuple[int, Hashable]:
    """The step below ``depth``: where item ``depth`` ends, and the next item's first bytes (the
    third item whole, hashed, at the last step)."""
    e = ends[depth]
    if depth < DEPTH - 1:
        return e, body[e + 1 : e + 1 + WINDOW]
    return e, hash(body[ends[depth - 1] + 1 : e + 1])


class LayoutIndex:
    """Kept layouts by their first bytes, then by their first three items. Not thread-safe:
    ``HistoryMemo`` calls it under its lock."""

    def __init__(self) -> None:
        self._roots: dict[tuple, _Node] = {}
        self._all: dict[tuple, dict[Hashable, int]] = {}  # a bucket's layouts, whatever their depth
        self._tick = 0

    def add(self, scope: tuple, key: Hashable, layout: Layout) -> None:
        """Index ``key``'s layout (``scope``: what else tells conversations apart, e.g. the
        dialect and session). A key is added once; ``remove`` it before adding it again."""
        self._tick += 1
        body, ends = layout.body, layout.ends
        root_key = (*scope, body[layout.start + 1 : layout.start + 1 + WINDOW])
        self._all.setdefault(root_key, {})[key] = self._tick
        node = self._roots.setdefault(root_key, _Node())
        for depth in range(min(len(ends), DEPTH)):
            edge = _edge(body, ends, depth)
            child = node.children.get(edge)
            if child is None:
                child = node.children[edge] = _Node()
                node.ends[edge[0]] = node.ends.get(edge[0], 0) + 1
            node = child
        node.keys[key] = self._tick

    def remove(self, scope: tuple, key: Hashable, layout: Layout) -> None:
        body, ends = layout.body, layout.ends
        root_key = (*scope, body[layout.start + 1 : layout.start + 1 + WINDOW])
        path = [(self._roots.get(root_key), None)]
        for depth in range(min(len(ends), DEPTH)):
            node = path[-1][0]
            if node is None:
                return
            edge = _edge(body, ends, depth)
            path.append((node.children.get(edge), edge))
        node = path[-1][0]
        if node is None or node.keys.pop(key, None) is None:
            return
        bucket = self._all[root_key]
        del bucket[key]
        if not bucket:
            del self._all[root_key]
        for (parent, _), (child, edge) in zip(path[-2::-1], path[:0:-1]):  # prune empty nodes, leaf first
            if child.keys or child.children:
                return
            del parent.children[edge]
            if parent.ends[edge[0]] == 1:
                del parent.ends[edge[0]]
            else:
                parent.ends[edge[0]] -= 1
        root = path[0][0]
        if not root.keys and not root.children:
            del self._roots[root_key]

    def candidates(self, scope: tuple, raw: bytes, start: int, limit: int) -> list[Hashable]:
        """Keys whose layout ``raw`` may repeat (the same first bytes, and the same first three
        items' bytes where they were looked at), most recently kept first, at most ``limit``."""
        root_key = (*scope, raw[start + 1 : start + 1 + WINDOW])
        bucket = self._all.get(root_key)
        if bucket is None:
            return []
        if len(bucket) <= FEW:
            return sorted(bucket, key=bucket.__getitem__, reverse=True)[:limit]
        found: list[tuple[Hashable, int]] = []
        stack: list[tuple[_Node, list[int]]] = [(self._roots[root_key], [])]
        while stack:
            node, ends = stack.pop()
            found.extend(node.keys.items())
            for e in node.ends:
                path = [*ends, e]
                child = node.children.get(_edge(raw, path, len(ends)))
                if child is not None:
                    stack.append((child, path))
        if len(found) > 1:
            found.sort(key=itemgetter(1), reverse=True)
        return [k for k, _ in found[:limit]]
