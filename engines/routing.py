"""Consistent hashing of session ids onto engine replicas.

A session's turns share a growing prefix, so keeping a session on one replica keeps its prefix
cache warm. Virtual nodes spread sessions evenly; removing a replica moves only the sessions
that lived on it (each goes to the next replica clockwise), and that same ring order is the
failover order. The hash is blake2b, stable across processes and restarts (unlike ``hash()``).
"""

from __future__ import annotations

import bisect
import hashlib
from typing import Iterable


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
