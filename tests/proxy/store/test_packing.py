"""Packed token arrays round-trip exactly (property tests)."""

from __future__ import annotations

import os
import tempfile

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.store.records import TurnRecord
from proxy.store import Store
from proxy.store.packing import (
    common_prefix_len,
    pack_f32,
    pack_i32,
    pack_proximal,
    pack_runs,
    unpack_f32,
    unpack_i32,
    unpack_proximal,
    unpack_runs,
)

i32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)
f32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@given(st.lists(i32, max_size=200))
def test_i32_round_trip(values):
    assert unpack_i32(pack_i32(values)).tolist() == values
    assert len(pack_i32(values)) == 4 * len(values)


@given(st.lists(f32, max_size=200))
def test_f32_round_trip(values):
    assert unpack_f32(pack_f32(values)).tolist() == values


@given(st.lists(st.integers(-1, 3), max_size=300))
def test_runs_round_trip(values):
    blob = pack_runs(values)
    assert unpack_runs(blob).tolist() == values
    runs = sum(1 for i, v in enumerate(values) if i == 0 or values[i - 1] != v)
    assert len(blob) == 8 * runs


@st.composite
def token_arrays(draw):
    n = draw(st.integers(0, 60))
    versions = sorted(draw(st.lists(st.integers(0, 4), min_size=n, max_size=n)))
    lps = draw(st.lists(f32, min_size=n, max_size=n))
    recomputed = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    prox_vals = draw(st.lists(f32, min_size=n, max_size=n))
    prox = [p if r else lp for p, r, lp in zip(prox_vals, recomputed, lps)]
    prox_versions = [v + 1 if r else v for v, r in zip(versions, recomputed)]
    if n and draw(st.booleans()):  # a caller breaking "proximal == behaviour where not recomputed"
        prox[0] = prox_vals[0]
    return lps, versions, prox, prox_versions


@given(token_arrays())
def test_proximal_round_trip(arrays):
    lps, versions, prox, prox_versions = (np.asarray(a, dtype=d) for a, d in zip(arrays, ("<f4", "<i4", "<f4", "<i4")))
    lp_blob, pv_blob = pack_proximal(lps, versions, prox, prox_versions)
    got, got_v = unpack_proximal(lps, versions, lp_blob, pv_blob)
    assert got.view(np.int32).tolist() == prox.view(np.int32).tolist()
    assert got_v.tolist() == prox_versions.tolist()
    if np.array_equal(prox_versions, versions) and np.array_equal(prox.view(np.int32), lps.view(np.int32)):
        assert lp_blob is None and pv_blob is None


@settings(max_examples=40, deadline=None)
@given(token_arrays(), st.lists(st.integers(0, 151_935), max_size=40), st.lists(st.integers(0, 151_935), max_size=40))
def test_turn_round_trip_through_store(arrays, prompt_extra, prompt_tail):
    lps, versions, prox, prox_versions = arrays
    n = len(lps)
    with tempfile.TemporaryDirectory() as d:
        store = Store(os.path.join(d, "x.db"))
        store.sessions.upsert("s")
        t0 = TurnRecord(
            "t0", "s", 0, None, prompt_extra, list(range(7, 7 + n)), lps, versions, prox, prox_versions,
            False, "unknown_parent", "length", 1.0, {"temperature": 0.3}, True, "chat", "chatcmpl-0",
        )  # fmt: skip
        prompt1 = prompt_extra + t0.output_ids + prompt_tail
        t1 = TurnRecord(
            "t1", "s", 1, "t0", prompt1, [1, 2], [-0.25, -0.5], [4, 4], [-0.25, -0.5], [4, 4],
            True, None, "stop", 2.0, {}, False, "responses", "resp_1",
        )  # fmt: skip
        store.turns.add(t0)
        store.turns.add(t1)
        for s in (store, Store(os.path.join(d, "x.db"))):  # warm cache, then a cold reopen
            got0, got1 = s.turns.list("s")
            assert got0 == t0 and got1 == t1
            assert s.turns.get("t1") == t1
            s.close()


@given(a=st.lists(st.integers(0, 5), max_size=50), b=st.lists(st.integers(0, 5), max_size=50))
def test_common_prefix_len(a, b):
    want = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    assert common_prefix_len(np.asarray(a, np.int32), np.asarray(b, np.int32)) == want
