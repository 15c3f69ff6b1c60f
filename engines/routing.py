"""Routing sessions onto engine replicas: consistent hashing (default) or load-aware sticky.

A session's turns share a growing prefix, so keeping a session on one replica keeps its prefix
cache warm. Virtual nodes spread sessions evenly; removing a replica moves only the sessions
that lived on it (each goes to the next replica clockwise), and that same ring order is the
failover order. The hash is blake2b, stable across processes and restarts (unlike ``hash()``).

``StickyTable`` is the load-aware alternative (``splice serve --routing least-loaded``): a new
session goes to the replica with the fewest in-flight calls, then stays there.
"""

from __future__ import annotations

import bisect
import hashlib
from collections import OrderedDict
from typing import Callable, Iterable, Mapping

ROUTING_POLICIES = ("hash", "least-loaded")


def _hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "big")


class HashRing:
    """Replicas placed on a 64-bit ring at ``vnodes`` points each."""

    def __init__(self, nodes: Iterable[str] = (), *, vnodes: int = 160):
        if vnodes < 1:
            raise ValueError("vnodes must be >= 1")
        self.vnodes = vnodes
        self._points: list[int] = []
        self._owners: list[str] = []
        self._nodes: list[str] = []
        for node in nodes:
            self.add(node)

    @property
    def nodes(self) -> list[str]:
        return list(self._nodes)

    def add(self, node: str) -> None:
        if node in self._nodes:
            return
        self._nodes.append(node)
        for i in range(self.vnodes):
            point = _hash(f"{node}#{i}")
            idx = bisect.bisect_left(self._points, point)
            self._points.insert(idx, point)
            self._owners.insert(idx, node)

    def remove(self, node: str) -> None:
        if node not in self._nodes:
            return
        self._nodes.remove(node)
        keep = [(p, o) for p, o in zip(self._points, self._owners) if o != node]
        self._points = [p for p, _ in keep]
        self._owners = [o for _, o in keep]

    def preference(self, key: str) -> list[str]:
        """Every replica once, in the order to try them for ``key`` (owner first, then failover)."""
        if not self._points:
            return []
        start = bisect.bisect_right(self._points, _hash(key)) % len(self._points)
        order: list[str] = []
        n = len(self._points)
        for step in range(n):
            owner = self._owners[(start + step) % n]
            if owner not in order:
                order.append(owner)
                if len(order) == len(self._nodes):
                    break
        return order

    def node_for(self, key: str) -> str:
        order = self.preference(key)
        if not order:
            raise LookupError("the hash ring has no replicas")
        return order[0]


class StickyTable:
    """Session -> replica assignments for the load-aware sticky policy (``--routing least-loaded``).

    A session is placed once, on the usable replica with the fewest in-flight engine calls (ties
    go to the session's hash-ring order, so placement is deterministic), and stays there while
    that replica is usable. Only the most recent ``capacity`` sessions are remembered (least
    recently used forgotten first); a forgotten session is simply placed again.
    """

    def __init__(self, capacity: int = 100_000):
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._table: "OrderedDict[str, str]" = OrderedDict()

    def __len__(self) -> int:
        return len(self._table)

    def get(self, session: str) -> str | None:
        node = self._table.get(session)
        if node is not None:
            self._table.move_to_end(session)
        return node

    def assign(self, session: str, node: str) -> None:
        self._table[session] = node
        self._table.move_to_end(session)
        while len(self._table) > self.capacity:
            self._table.popitem(last=False)

    def forget_node(self, node: str) -> None:
        for s in [s for s, n in self._table.items() if n == node]:
            del self._table[s]

    def place(self, session: str, ring_order: list[str], load: Mapping[str, int], usable: Callable[[str], bool]) -> list[str]:
        """Every replica once, in the order to try them for ``session``: its sticky replica first
        when usable, else a new placement (least loaded usable replica, ring order breaking ties),
        which is remembered; the rest in ring order (the failover order)."""
        current = self.get(session)
        if current is None or current not in ring_order or not usable(current):
            candidates = [n for n in ring_order if usable(n)]
            if not candidates:
                return list(ring_order)
            rank = {n: i for i, n in enumerate(ring_order)}
            current = min(candidates, key=lambda n: (load.get(n, 0), rank[n]))
            self.assign(session, current)
        return [current] + [n for n in ring_order if n != current]
