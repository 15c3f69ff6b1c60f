"""The prompt's tail the bridges and the parser read: from its last turn close on, as a list of
Python ints, whether the prompt is a list or the store's int32 array (checked against a plain
backward scan)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenization.bridge import prompt_tail


def _scan(ids: list[int], close: set[int], limit: int) -> list[int]:
    stop = max(0, len(ids) - limit)
    for i in range(len(ids) - 1, stop - 1, -1):
        if ids[i] in close:
            return ids[i:]
    return ids[stop:]


@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.integers(0, 40), max_size=3000) | st.integers(0, 6000).map(lambda n: [7] * n + [0] + [9] * 5),
    limit=st.sampled_from([1, 200, 4096]),
)
def test_prompt_tail_is_the_backward_scan_for_lists_and_arrays(ids, limit):
    close = {0, 1}
    want = _scan(ids, close, limit)
    for form in (ids, np.asarray(ids, dtype=np.int32)):
        got = prompt_tail(form, close, limit)
        assert got == want and all(type(t) is int for t in got)
