"""Id chains: every array ``join`` gives holds exactly the ids of its parts (the reference: plain
Python lists), whatever the order of joins, siblings and threads; no array it gave ever changes."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenization import id_chain


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(st.tuples(st.integers(0, 30), st.lists(st.integers(0, 151_000), max_size=6), st.booleans(), st.integers(0, 5)),
                      min_size=1, max_size=40))  # fmt: skip
def test_joined_arrays_hold_their_parts_and_never_change(steps):
    """A tree of turns: each step splices onto an earlier one (a parent, often one that already has
    a child: a sibling must not overwrite it), as prompt + output + bridge, the store's way."""
    made: list[tuple[np.ndarray, list[int]]] = [(id_chain.join([1, 2, 3]), [1, 2, 3])]
    for parent, new, split, extra in steps:
        arr, ref = made[parent % len(made)]
        k = min(extra, arr.size)
        if split:  # the parent's (prompt, output) halves, as the store hands them out
            out = id_chain.join(arr[: arr.size - k], arr[arr.size - k :], new)
        else:
            out = id_chain.join(arr, new)
        made.append((out, ref + new))
        for a, r in made:  # nothing given out earlier has changed
            assert a.tolist() == r
    for a, _ in made:
        assert a.dtype == np.int32 and not a.flags.writeable


def test_a_splice_appends_in_place_and_a_sibling_gets_a_copy():
    parent = id_chain.join(np.arange(1000, dtype=np.int32), [5, 6])
    prompt, output = parent[:1000], parent[1000:]
    child = id_chain.join(prompt, output, [7, 8])
    assert child.base is parent.base  # no copy of the 1,002 ids before it
    sibling = id_chain.join(prompt, output, [9])
    assert sibling.base is not parent.base and sibling.tolist() == [*range(1000), 5, 6, 9]
    assert child.tolist() == [*range(1000), 5, 6, 7, 8]
    assert id_chain.known_prefix(parent, child) and not id_chain.known_prefix(parent, sibling)
    assert not id_chain.known_prefix(child, parent)  # longer: not a prefix
    with pytest.raises(ValueError):
        child[0] = 1  # read-only: ids written once are never written again


def test_known_prefix_says_nothing_of_arrays_outside_a_chain():
    a = np.arange(10, dtype=np.int32)
    assert not id_chain.known_prefix(a, a) and not id_chain.is_chain(a)
    chain = id_chain.join(a)
    assert id_chain.is_chain(chain) and not id_chain.is_chain(chain[1:])  # not from the start
    assert not id_chain.known_prefix(chain[1:], chain[1:5])
    assert id_chain.join(chain.astype(np.int64), [1]).tolist() == [*range(10), 1]


def test_buffers_grow_by_a_quarter_and_are_forgotten_when_freed():
    arr = id_chain.join(np.zeros(4000, dtype=np.int32))
    copies = 0
    for i in range(4000):
        nxt = id_chain.join(arr, [i])
        copies += nxt.base is not arr.base
        arr = nxt
    assert copies <= 4  # 4,000 -> 8,000 ids in steps of a quarter
    assert arr.base.size < 2 * arr.size
    before = len(id_chain._written)
    del arr, nxt
    gc.collect()
    assert len(id_chain._written) < before


def test_threads_splicing_onto_one_parent_each_get_their_own_ids():
    parent = id_chain.join(np.arange(50_000, dtype=np.int32))
    results: dict[int, np.ndarray] = {}
    start = threading.Barrier(8)

    def splice(t: int) -> None:
        start.wait()
        results[t] = id_chain.join(parent, [t] * 100)

    threads = [threading.Thread(target=splice, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert sum(r.base is parent.base for r in results.values()) == 1  # one appended in place
    for t, r in results.items():
        assert r[:50_000].tolist() == parent.tolist() and r[50_000:].tolist() == [t] * 100
