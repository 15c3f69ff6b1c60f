"""The Responses conversation cache is bounded by the memory it really holds (measured here with
tracemalloc, independently of the cache's own count), keeps about one conversation per session
(a session's newest contains its earlier ones), and an evicted conversation is rebuilt exactly
from its stored deltas."""

from __future__ import annotations

import gc
import tracemalloc

import orjson

from proxy.store import Store
from proxy.store.lru import LRU, memory_of


def _conversation(session: int, turns: int) -> bytes:
    msgs = [{"role": "system", "content": "You are a careful agent."}, {"role": "user", "content": f"task {session}"}]
    for t in range(turns):
        msgs.append({"role": "assistant", "content": "", "tool_calls": [{"id": f"call_{session}_{t}", "name": "f", "arguments": '{"x": 1}'}]})
        msgs.append({"role": "tool", "tool_call_id": f"call_{session}_{t}", "content": f"step {t} " + "x" * 40})
    return orjson.dumps(msgs)


def test_the_budget_counts_what_the_entries_really_hold():
    values = [bytes(range(256)) * (1 + i % 7) + str(i).encode() for i in range(3000)]  # many small values: overhead shows
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    cache = LRU(1 << 40, weigh=memory_of)
    for i, v in enumerate(values):
        cache.put(i, v)
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - base  # the entries; the values existed before
    tracemalloc.stop()
    values_bytes = sum(len(v) for v in values)
    true_total = held + sum(memory_of(v) - 128 for v in values)  # entries + the value objects they keep alive
    assert abs(cache.used - true_total) / true_total < 0.15, (cache.used, true_total)
    assert cache.used > values_bytes * 1.1  # more than JSON length would say


def test_about_one_conversation_per_session_is_cached_and_the_rest_rebuilds_exactly(tmp_path):
    store = Store(str(tmp_path / "s.sqlite"))
    try:
        table = store.responses
        for s in range(40):
            for t in range(8):
                table.put(f"resp_{s}_{t}", f"sess-{s}", None, b"{}", _conversation(s, t))
        cache = table._convs
        assert len(cache) == 40  # each session's newest; the earlier ones were superseded
        assert cache.used == sum(memory_of(_conversation(s, 7)) for s in range(40))
        for s in (0, 17, 39):
            for t in (0, 3, 7):
                assert table.get(f"resp_{s}_{t}")[1] == _conversation(s, t)  # rebuilt from deltas
    finally:
        store.close()


def test_the_cache_stays_within_its_budget(tmp_path, monkeypatch):
    from proxy.store import responses

    monkeypatch.setattr(responses, "CONVERSATION_CACHE_BYTES", 64 << 10)
    store = Store(str(tmp_path / "s.sqlite"))
    try:
        for s in range(200):
            for t in range(4):
                store.responses.put(f"r{s}_{t}", f"s{s}", None, b"{}", _conversation(s, t))
        cache = store.responses._convs
        assert 0 < cache.used <= 64 << 10 and len(cache) < 200
        assert store.responses.get("r3_2")[1] == _conversation(3, 2)
    finally:
        store.close()
