"""The streaming detokenizer: exact text, channel attribution, bounded work per token."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenization.incremental import (
    CONTENT,
    REASONING,
    TOOL_CALL,
    IncrementalDecoder,
    StrippedText,
    generation_starts_in_reasoning,
    token_bytes,
)
from tokenization.parse import parse_output


def _run(dec: IncrementalDecoder, ids: list[int], sizes: list[int]) -> list[tuple[str, str]]:
    events: list[tuple[str, str]] = []
    i = 0
    k = 0
    while i < len(ids):
        n = sizes[k % len(sizes)] if sizes else 1
        events += dec.feed(ids[i : i + n])
        i += n
        k += 1
    events += dec.finish()
    return events


def _by_channel(events):
    out: dict[str, str] = {}
    for ch, t in events:
        assert t, "empty deltas are never emitted"
        out[ch] = out.get(ch, "") + t
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(min_size=1, max_size=80), sizes=st.lists(st.integers(1, 4), min_size=1, max_size=5))
def test_deltas_concatenate_to_full_decode(tok, text, sizes):
    ids = tok.encode(text, add_special_tokens=False)
    special = set(tok.all_special_ids) | {tok.convert_tokens_to_ids(t) for t in ("<think>", "</think>", "<tool_call>", "</tool_call>")}
    if any(i in special for i in ids):
        return  # the text spelled a structure token; covered by the attribution tests
    events = _run(IncrementalDecoder(tok), ids, sizes)
    assert all(ch == CONTENT for ch, _ in events)
    joined = "".join(t for _, t in events)
    assert joined == tok.decode(ids)
    assert "\ufffd" not in joined or "\ufffd" in text


def test_multibyte_split_across_tokens_never_emits_replacement(tok):
    text = "🤖🦾 ü 你好 ✨ שלום 𝔘𝔫𝔦𝔠𝔬𝔡𝔢"
    ids = tok.encode(text, add_special_tokens=False)
    # several tokens are partial UTF-8 sequences on their own
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    dec = IncrementalDecoder(tok)
    deltas = []
    for i in ids:
        for _, t in dec.feed([i]):
            assert "\ufffd" not in t
            deltas.append(t)
    deltas += [t for _, t in dec.finish()]
    assert "".join(deltas) == text


def test_channels_think_text_tool_call(tok, renderer):
    text = (
        "<think>\nPlan: call f — ok ✓\n</think>\n\nSure, calling f.\n"
        '<tool_call>\n{"name": "f", "arguments": {"q": "日本"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call><|im_end|>'
    )
    ids = tok.encode(text, add_special_tokens=False)
    for sizes in ([1], [2, 5], [len(ids)]):
        dec = IncrementalDecoder(tok)
        got = _by_channel(_run(dec, ids, sizes))
        assert got[REASONING] == "\nPlan: call f — ok ✓\n"
        assert got[CONTENT] == "\n\nSure, calling f.\n"
        assert got[TOOL_CALL] == '\n{"name": "f", "arguments": {"q": "日本"}}\n\n{"name": "g", "arguments": {}}\n'
        assert dec.tool_call_texts == ['\n{"name": "f", "arguments": {"q": "日本"}}\n', '\n{"name": "g", "arguments": {}}\n']
        assert dec.stopped
        # the same split as the authoritative parse
        parsed = parse_output(renderer, ids)
        assert got[REASONING].strip() == parsed.reasoning and got[CONTENT].strip() == parsed.content
        assert sum(dec.token_counts.values()) == len(ids)


def test_tool_call_closes_open_reasoning_and_stop_drops_the_rest(tok):
    ids = tok.encode('<think>\nhm\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>after', add_special_tokens=False)
    dec = IncrementalDecoder(tok)
    got = _by_channel(_run(dec, ids, [1]))
    assert got[REASONING] == "\nhm\n" and CONTENT not in got
    assert got[TOOL_CALL] == '\n{"name": "f", "arguments": {}}\n'
    assert "after" not in "".join(got.values())


def test_think_after_text_is_literal(tok):
    ids = tok.encode("Hello <think>x</think> bye", add_special_tokens=False)
    got = _by_channel(_run(IncrementalDecoder(tok), ids, [1]))
    assert got == {CONTENT: "Hello <think>x</think> bye"}


def test_generation_that_starts_inside_reasoning(tok):
    ids = tok.encode("prefilled thoughts\n</think>\n\nanswer", add_special_tokens=False)
    got = _by_channel(_run(IncrementalDecoder(tok, start_in_reasoning=True), ids, [3]))
    assert got == {REASONING: "prefilled thoughts\n", CONTENT: "\n\nanswer"}


def test_qwen3_generation_prompt_does_not_open_reasoning(tok, renderer):
    assert generation_starts_in_reasoning(tok, renderer) is False


def test_work_per_token_is_bounded(tok):
    """Every decode call sees a short window, however long the output."""

    class Counting:
        def __init__(self, inner):
            self.inner = inner
            self.max_len = 0
            self.calls = 0

        def decode(self, ids, **kw):
            self.max_len = max(self.max_len, len(ids))
            self.calls += 1
            return self.inner.decode(ids, **kw)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    rng = random.Random(0)
    words = ["alpha", "β", "γάμμα", "🙂", "数据", "naïve", "x", "\n"]
    text = " ".join(rng.choice(words) for _ in range(1500))
    ids = tok.encode(text, add_special_tokens=False)
    wrapped = Counting(tok)
    dec = IncrementalDecoder(wrapped)
    out = "".join(t for _, t in _run(dec, ids, [1]))
    assert out == text
    assert len(ids) > 1500
    assert wrapped.max_len <= 8
    assert wrapped.calls <= 3 * len(ids)


def test_stripped_text():
    s = StrippedText()
    pieces = ["\n\n", "  Hello", " ", "world", "  \n", "", "!", " \n"]
    sent = "".join(s.push(p) for p in pieces)
    assert sent == "Hello world  \n!" == "".join(pieces).strip()
    assert s.remainder("Hello world  \n!") == ""
    assert s.remainder("Hello world  \n! more") == " more"
    assert s.remainder("different") is None


def test_token_bytes_are_exact(tok):
    text = "a🙂b 数据 <think>"
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(token_bytes(tok, ids)) == text.encode("utf-8")


@pytest.mark.parametrize("sizes", [[1], [7]])
def test_unclosed_tool_call_and_truncated_reasoning(tok, sizes):
    ids = tok.encode("<think>\nstill thinking about 💡", add_special_tokens=False)
    dec = IncrementalDecoder(tok)
    got = _by_channel(_run(dec, ids, sizes))
    assert got == {REASONING: "\nstill thinking about 💡"} and not dec.reasoning_done
    ids = tok.encode('ok <tool_call>\n{"name": "f", "argu', add_special_tokens=False)
    dec = IncrementalDecoder(tok)
    got = _by_channel(_run(dec, ids, sizes))
    assert got == {CONTENT: "ok ", TOOL_CALL: '\n{"name": "f", "argu'}


@pytest.mark.parametrize(
    "text,start,expected_from_decoder",
    [
        ("<think>\nab cd\n</think>\n\nhi<|im_end|>", False, True),
        ("  <think>\nab\n<tool_call>\n{}\n</tool_call><|im_end|>", False, True),
        ("x <think>\nab\n</think>", False, True),
        ("ab cd\n</think>\n\nok", True, True),
        ("<think>\nnever closed", False, True),
        ("plain text", False, True),
    ],
)
def test_reasoning_token_count_matches_decoder(tok, text, start, expected_from_decoder):
    from tokenization.incremental import reasoning_token_count

    ids = tok.encode(text, add_special_tokens=False)
    dec = IncrementalDecoder(tok, start_in_reasoning=start)
    dec.feed(ids)
    assert reasoning_token_count(tok, ids, start_in_reasoning=start) == dec.token_counts[REASONING]
