"""The stitching rules of R1 on plain Segments (no HTTP)."""

from __future__ import annotations

from engines.resume import Stitcher, parse_version, token_versions
from engines.types import SamplingParams, Segment


def seg(ids, lps, finish="abort", *, inputs=(), start=0, wv=None, spans=()):
    return Segment(list(ids), list(lps), finish, input_logprobs=list(inputs), input_logprobs_start=start,
                   weight_version=wv, weight_version_spans=tuple(spans))


def test_parse_version():
    assert parse_version("12") == 12 and parse_version(" 3 ") == 3
    assert parse_version("default") is None and parse_version(None) is None and parse_version("-1") is None


def test_spans_stamp_each_token_and_fall_back_when_incomplete():
    s = seg([1, 2, 3], [0, 0, 0], wv="5", spans=[(0, 1, "4"), (1, 3, "5")])
    assert token_versions(s, 0) == ([4, 5, 5], 4)
    s = seg([1, 2, 3], [0, 0, 0], wv="5", spans=[(0, 1, "4")])  # does not cover every token
    assert token_versions(s, 0) == ([5, 5, 5], 5)
    assert token_versions(seg([1], [0], wv="default"), 9) == ([9], 9)


def test_values_are_placed_by_absolute_position_whatever_the_reply_start():
    st = Stitcher([1, 2, 3], SamplingParams(max_new_tokens=10))
    st.add(seg([10, 11], [-1.0, -1.1]), 0)
    assert st.logprobs_from(1) == 3 and st.logprobs_from(0) is None
    # a reply that starts at position 0 (vLLM echo): entries for positions 0..4
    st.add(seg([12], [-1.2], inputs=[None, -9.1, -9.2, -9.3, -9.4], start=0), 1)
    assert st.gen.proximal_logprobs_t == [-9.3, -9.4, -1.2]
    assert st.gen.proximal_versions == [1, 1, 1]
    # a reply that starts at position 2 (SGLang logprob_start_len = len(prompt) - 1)
    st.add(seg([13], [-1.3], inputs=[None, -8.3, -8.4, -8.5], start=2), 2)
    assert st.gen.proximal_logprobs_t == [-9.3, -9.4, -8.5, -1.3]  # only the v1 token changes
    assert st.gen.proximal_versions == [1, 1, 2, 2]


def test_budget_and_settle():
    st = Stitcher([1], SamplingParams(max_new_tokens=3))
    st.add(seg([5, 6], [-1.0, -1.0]), 0)
    assert not st.settle() and st.remaining == 1 and st.next_params().max_new_tokens == 1
    assert st.next_input_ids() == [1, 5, 6]
    st.add(seg([7], [-1.0]), 0)
    assert st.settle() and st.gen.finish_reason == "length"
    assert st.gen.segments == 2 and st.gen.aborts == 2
