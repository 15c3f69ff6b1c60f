"""Prefix reuse: the KV caches of recently finished sequences, so a prompt that shares a prefix
with one of them prefills only the tokens after it.

A spliced agent turn's prompt is by construction the previous turn's prompt + its output + a
short bridge, so on a 21k-token Claude Code prompt the second turn would otherwise re-read
20k+ tokens it has already seen. Keys and values at position ``i`` depend only on tokens
``0..i`` (causal attention), so the KV of any common prefix is exactly what a fresh prefill
would compute (up to float rounding of a different chunking).

Bounded: entries are kept least-recently-used first out, under a byte budget (the sum of the
cached key and value tensors) and an entry count. A weight update clears everything: the
epoch a job was admitted under must match for its cache to be kept, so a job that straddles
an update (an in-place pause) never stores KV computed with older weights.
"""

from __future__ import annotations

import collections
import copy
from dataclasses import dataclass

import numpy as np
import torch

DEFAULT_MAX_MB = 1024  # ~500k tokens of the bundled tiny model (2 KiB of KV per token)
MAX_ENTRIES = 32  # bounds the per-request scan (one vectorised comparison per entry)
MIN_REUSE = 16  # shorter common prefixes are not worth a copy


def cache_nbytes(cache) -> int:
    """Bytes held by a transformers KV cache's key and value tensors."""
    layers = getattr(cache, "layers", None)
    if layers is not None:  # transformers >= 4.56: one object per layer
        pairs = [(getattr(lay, "keys", None), getattr(lay, "values", None)) for lay in layers]
    else:  # older DynamicCache: parallel lists
        pairs = list(zip(getattr(cache, "key_cache", []), getattr(cache, "value_cache", [])))
    return sum(t.numel() * t.element_size() for pair in pairs for t in pair if isinstance(t, torch.Tensor))


@dataclass
class _Entry:
    ids: np.ndarray  # the tokens whose KV the cache holds (exactly its length)
    cache: object
    nbytes: int


@dataclass(frozen=True)
class Hit:
    """A reusable prefix: ``cache`` is a private copy holding the KV of the first ``tokens`` ids."""

    tokens: int
    cache: object


class PrefixCache:
    """LRU of finished sequences' KV caches. Used by the worker thread only (not thread-safe)."""

    def __init__(self, max_bytes: int, *, max_entries: int = MAX_ENTRIES, min_reuse: int = MIN_REUSE):
        self.max_bytes = int(max_bytes)
        self.max_entries = int(max_entries)
        self.min_reuse = int(min_reuse)
        self.epoch = 0  # bumped by clear(): caches of jobs admitted earlier are not stored
        self._entries: collections.OrderedDict[int, _Entry] = collections.OrderedDict()
        self._next_key = 0
        self.nbytes = 0
        self.hits = 0
        self.reused_tokens = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, ids: list[int], limit: int) -> Hit | None:
        """The longest cached common prefix of ``ids`` (at most ``limit`` tokens), as a copy the
        caller may extend; None when nothing of at least ``min_reuse`` tokens matches."""
        if not self._entries or limit < self.min_reuse:
            return None
        want = np.asarray(ids[:limit], dtype=np.int64)
        best_key, best_n = None, 0
        for key, e in self._entries.items():
            n = min(len(e.ids), len(want))
            if n <= best_n:
                continue
            diff = np.flatnonzero(e.ids[:n] != want[:n])
            common = int(diff[0]) if diff.size else n
            if common > best_n:
                best_key, best_n = key, common
        if best_key is None or best_n < self.min_reuse:
            return None
        entry = self._entries[best_key]
        self._entries.move_to_end(best_key)
        with torch.inference_mode():
            cache = copy.deepcopy(entry.cache)
            if best_n < len(entry.ids):  # negative: "remove this many" in every transformers version
                cache.crop(best_n - len(entry.ids))
        self.hits += 1
        self.reused_tokens += best_n
        return Hit(best_n, cache)

    def insert(self, ids: list[int], cache, epoch: int) -> None:
        """Keep ``cache`` (ownership passes here), which holds the KV of ``ids[:its length]``."""
        if not self.enabled or epoch != self.epoch or cache is None:
            return
        n = int(cache.get_seq_length())
        if n < self.min_reuse or n > len(ids):
            return
        nbytes = cache_nbytes(cache)
        if nbytes > self.max_bytes:
            return
        seq = np.asarray(ids[:n], dtype=np.int64)
        for key, e in list(self._entries.items()):  # an entry this one extends is redundant now
            if len(e.ids) <= n and np.array_equal(e.ids, seq[: len(e.ids)]):
                self._drop(key)
        self._entries[self._next_key] = _Entry(seq, cache, nbytes)
        self._next_key += 1
        self.nbytes += nbytes
        while self._entries and (self.nbytes > self.max_bytes or len(self._entries) > self.max_entries):
            self._drop(next(iter(self._entries)))

    def clear(self) -> None:
        """Forget everything (the weights changed) and refuse caches of jobs admitted before."""
        self._entries.clear()
        self.nbytes = 0
        self.epoch += 1

    def stats(self) -> dict:
        return {"entries": len(self._entries), "bytes": self.nbytes, "max_bytes": self.max_bytes,
                "hits": self.hits, "reused_tokens": self.reused_tokens}  # fmt: skip

    def _drop(self, key: int) -> None:
        e = self._entries.pop(key)
        self.nbytes -= e.nbytes
