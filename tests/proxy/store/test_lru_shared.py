"""The turn-ids cache counts a session's chain buffer once, so long sessions stay warm.

Each turn of a session is a view of one chain buffer (tokenization/id_chain.py). Counting each
view at its full length (against a budget of 4M ids) made 50 interleaved sessions of 100k
tokens evict one another, and every turn then rebuilt its parent's ids from SQLite."""

from __future__ import annotations

import numpy as np

from proxy.store import Store
from proxy.store.lru import LRU, SHARED_ENTRY_BYTES
from proxy.store.turns import FULL_IDS_BYTES
from tokenization import id_chain


def test_views_of_one_buffer_count_it_once_until_the_last_leaves():
    cache = LRU(1 << 30, shared=id_chain.held_memory)
    prompt = id_chain.join(np.arange(1000, dtype=np.int32))
    buf = prompt.base
    views = [prompt]
    for k in range(9):  # each turn appends to the same buffer
        views.append(id_chain.join(views[-1], [k]))
    assert all(v.base is buf for v in views)
    for i, v in enumerate(views):
        cache.put(i, v)
    per_entry = SHARED_ENTRY_BYTES * len(views)
    assert cache.used == buf.nbytes + per_entry
    cache.pop(0)
    assert cache.used == buf.nbytes + per_entry - SHARED_ENTRY_BYTES  # the buffer is still held
    for i in range(1, 10):
        cache.pop(i)
    assert cache.used == 0 and cache._holders == {}


def test_separate_buffers_count_separately_and_evict_oldest_first():
    a = id_chain.join(np.arange(1000, dtype=np.int32))
    b = id_chain.join(np.arange(1000, dtype=np.int32))
    assert a.base is not b.base
    cache = LRU(a.base.nbytes + SHARED_ENTRY_BYTES + 100, shared=id_chain.held_memory)
    cache.put("a", a)
    cache.put("b", b)  # both do not fit: a goes
    assert cache.get("a") is None and cache.get("b") is b
    assert cache.used == b.base.nbytes + SHARED_ENTRY_BYTES


def test_fifty_interleaved_sessions_of_100k_tokens_stay_cached(tmp_path):
    store = Store(str(tmp_path / "s.db"))
    cache = store.turns._full_ids  # the cache as the store configures it
    rng = np.random.default_rng(0)
    last: dict[int, int] = {}
    chains = {s: id_chain.join(rng.integers(0, 150_000, 100_000, dtype=np.int32)) for s in range(50)}
    seq = 0
    for _turn in range(6):  # round robin, as agents in flight are
        for s in range(50):
            chains[s] = id_chain.join(chains[s], rng.integers(0, 150_000, 60, dtype=np.int32))
            seq += 1
            cache.put(seq, chains[s])
            last[s] = seq
    assert all(cache.get(last[s]) is not None for s in range(50))
    # counted one buffer a session, not one 100k view a turn (300 of them would be 120 MB)
    assert cache.used < 50 * 100_000 * 4 * 1.3 + 300 * 1024
    assert cache.budget == FULL_IDS_BYTES
    store.close()
