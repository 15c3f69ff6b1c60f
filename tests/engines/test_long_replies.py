"""Replies of hundreds of tokens and prefills of thousands are parsed in bulk (numpy and C-level
passes) past ``VECTOR_MIN`` values; every value and every error must be what the per-value rules
give: a logprob is ``float(v)`` unless null, NaN or below -9999 (then -9999), an id is the wire's
int, a malformed entry or a wrong input id names its place."""

from __future__ import annotations

import struct

import pytest

from tests.fakes.engines import Step, sglang_reply, vllm_generate_reply, vllm_reply
from engines.http import VECTOR_MIN, clean_logprobs
from engines.sglang import parse_response
from engines.types import EngineBadResponse, EngineImage

URL = "http://sglang-a:30000"
N = 4 * VECTOR_MIN


def floor_rule(v) -> float:
    """The rule written out in float64, independent of the code under test."""
    if v is None:
        return -9999.0
    x = float(v)
    return -9999.0 if x != x or x < -9999.0 else x


def bits(xs) -> list[bytes]:
    return [struct.pack("<d", x) for x in xs]


WIRE = [-0.0, 0.0, None, float("nan"), float("-inf"), float("inf"), -9999.0, -9999.000001, -1e-300, 5e-324,
        -0.1, -2.5, 0, -3, True, 1e308, -1e308, 0.1 + 0.2]  # fmt: skip


def test_bulk_values_equal_the_rule_bit_for_bit():
    values = (WIRE * (N // len(WIRE) + 1))[:N]
    got = clean_logprobs(values)
    assert len(got) == N and all(type(x) is float for x in got)
    assert bits(got) == bits(floor_rule(v) for v in values)
    short = WIRE[: VECTOR_MIN - 1]  # the per-value path gives the same
    assert bits(clean_logprobs(short)) == bits(floor_rule(v) for v in short)


@pytest.mark.parametrize("bad, error", [("abc", ValueError), ({"lp": 1}, TypeError), ([1.0], TypeError), (10**400, OverflowError)])
def test_a_value_that_is_no_number_fails_as_one_at_a_time(bad, error):
    values = [-0.5] * N
    values[N - 3] = bad
    with pytest.raises(error):
        clean_logprobs(values)


def _long(n_out: int = N, start: int = 1, prompt_len: int = 3 * N, **kw) -> tuple[list[int], dict]:
    prompt = [1000 + (7 * i) % 5000 for i in range(prompt_len)]
    toks = [(50 + i, -(i % 17) / 8 - (0.0 if i % 5 else 1e-9)) for i in range(n_out)]
    return prompt, sglang_reply(prompt, Step(toks), logprob_start_len=start, prefill=lambda p: -p / 4096, **kw)


def test_a_long_reply_parses_to_the_wire_values():
    prompt, reply = _long()
    seg = parse_response(reply, prompt, 1, URL)
    triples = reply["meta_info"]["output_token_logprobs"]
    assert seg.output_ids == [t[1] for t in triples] and all(type(i) is int for i in seg.output_ids)
    assert bits(seg.logprobs) == bits(floor_rule(t[0]) for t in triples)
    inputs = reply["meta_info"]["input_token_logprobs"]
    assert seg.input_logprobs[0] is None and len(seg.input_logprobs) == len(prompt) - 1
    assert bits(seg.input_logprobs[1:]) == bits(floor_rule(t[0]) for t in inputs[1:])


def test_a_malformed_entry_deep_in_a_long_reply_is_named():
    prompt, reply = _long()
    reply["meta_info"]["output_token_logprobs"][N - 5] = [-0.5]
    with pytest.raises(EngineBadResponse, match=r"malformed meta_info.output_token_logprobs entry \[-0.5\]"):
        parse_response(reply, prompt, 1, URL)
    prompt, reply = _long()
    reply["meta_info"]["input_token_logprobs"][2 * N] = "x"
    with pytest.raises(EngineBadResponse, match="malformed meta_info.input_token_logprobs entry 'x'"):
        parse_response(reply, prompt, 1, URL)


def test_ids_that_are_not_ints():
    prompt, reply = _long()
    reply["meta_info"]["output_token_logprobs"][N - 2][1] = "id"
    reply["output_ids"] = None
    with pytest.raises(EngineBadResponse, match="non-integer token id"):
        parse_response(reply, prompt, 1, URL)
    prompt, reply = _long()
    reply["meta_info"]["output_token_logprobs"][N - 2][1] = 51.0  # a float that is an integer reads as one
    reply["output_ids"] = None
    seg = parse_response(reply, prompt, 1, URL)
    assert seg.output_ids[N - 2] == 51 and type(seg.output_ids[N - 2]) is int


def test_the_first_wrong_input_id_of_a_long_prefill_is_named():
    prompt, reply = _long()
    inputs = reply["meta_info"]["input_token_logprobs"]
    inputs[2 * N][1] += 1
    inputs[2 * N + 3][1] += 1
    with pytest.raises(EngineBadResponse, match=f"input logprob {2 * N} is for token {inputs[2 * N][1]}, expected "
                                                f"{prompt[1 + 2 * N]} at position {1 + 2 * N}"):  # fmt: skip
        parse_response(reply, prompt, 1, URL)
    prompt, reply = _long()
    reply["meta_info"]["input_token_logprobs"][N][1] = None  # an id the engine left out is not compared
    assert parse_response(reply, prompt, 1, URL).input_logprobs[N] == floor_rule(-(1 + N) / 4096)


def test_image_pads_in_a_long_prefill_are_not_compared():
    pads = frozenset(range(40, 40 + 2 * VECTOR_MIN))
    prompt, reply = _long(image_positions=pads)
    image = EngineImage(hash="h", data=b"", mime="image/png", offset=40, length=2 * VECTOR_MIN, grid_thw=(1, 16, 16))
    seg = parse_response(reply, prompt, 1, URL, images=(image,))
    assert len(seg.input_logprobs) == len(prompt) - 1 and seg.input_logprobs[50] == floor_rule(-51 / 4096)
    reply["meta_info"]["input_token_logprobs"][150][1] = 7  # past the image: still an error
    with pytest.raises(EngineBadResponse, match="position 151"):
        parse_response(reply, prompt, 1, URL, images=(image,))


def test_long_vllm_replies_parse_to_the_wire_values():
    from engines.vllm_wire import parse_completion, parse_generate, prompt_logprob_values

    prompt = [1000 + i for i in range(N)]
    wire = (WIRE * (N // len(WIRE) + 1))[:N]
    toks = [(50 + i, v) for i, v in enumerate(wire)]
    reply = vllm_reply(prompt, Step(toks), echo=True, prefill=lambda p: wire[p])
    seg = parse_completion(reply, prompt, echo=True, replica=URL)
    assert bits(seg.logprobs) == bits(floor_rule(v) for v in wire)
    assert seg.input_logprobs[0] is None and bits(seg.input_logprobs[1:]) == bits(floor_rule(v) for v in wire[1:])

    meta = {"prompt_token_ids": prompt, "mm_placeholders": None}
    gen = vllm_generate_reply(prompt, Step(toks), meta, None, "0")
    assert bits(parse_generate(gen, prompt, (), prompt_logprobs=False, replica=URL).logprobs) == bits(map(floor_rule, wire))

    raw = [None] + [{str(t): {"logprob": wire[j], "rank": 1}} for j, t in enumerate(prompt) if j]
    got = prompt_logprob_values(raw, prompt, URL)
    assert got[0] is None and bits(got[1:]) == bits(floor_rule(v) for v in wire[1:])
    raw[N - 4] = {"7": {"logprob": -1.0}}  # no entry for the prompt's own token, deep in the list
    with pytest.raises(EngineBadResponse, match=f"prompt logprob {N - 4} has no entry for token {prompt[N - 4]}"):
        prompt_logprob_values(raw, prompt, URL)


def test_an_input_id_past_int64_is_a_mismatch_not_a_crash():
    prompt, reply = _long()
    reply["meta_info"]["input_token_logprobs"][N][1] = 2**70
    with pytest.raises(EngineBadResponse, match=f"input logprob {N} is for token {2**70}"):
        parse_response(reply, prompt, 1, URL)
