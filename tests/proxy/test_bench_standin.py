"""The bench's engine stand-in counts a long prompt's ids without parsing them, and answers as if
it had: checked against orjson's full parse of the same bodies, written the way the proxy writes
them (engines/ids_json.py, engines/json_body.py)."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import orjson
import pytest

from engines.ids_json import IdsJson
from engines.json_body import content_bytes, encode_body
from proxy.bench.standin import COUNT_IDS_ABOVE, make_app, parse_generate


def _body(ids, **fields) -> bytes:
    """A /generate body as the proxy sends a long session's prompt: its ids as kept JSON pieces."""
    pieces = IdsJson(min_ids=1)("session", np.asarray(ids, dtype=np.int32))
    return content_bytes(encode_body({"input_ids": pieces, "rid": "r-1", **fields}))


def _reference(body: bytes) -> tuple[dict, int]:
    req = orjson.loads(body)
    ids = req.get("input_ids") or []
    return req, len(ids)


@pytest.mark.parametrize("n", [1, 2, 20_000, 100_000])
def test_a_long_prompt_is_counted_and_the_rest_parsed_as_a_full_parse_would(n):
    rng = np.random.default_rng(n)
    ids = rng.integers(0, 151_000, size=n)
    body = _body(ids, sampling_params={"max_new_tokens": 64, "stop": ["]", ","]}, image_data=["a,b]c"] * 3)
    if len(body) <= COUNT_IDS_ABOVE:  # a short prompt: padded past the threshold by another field
        body = _body(ids, sampling_params={"max_new_tokens": 64}, pad="x," * COUNT_IDS_ABOVE)
    req, count = parse_generate(body)
    ref, ref_count = _reference(body)
    assert count == ref_count == n
    assert req == {**ref, "input_ids": []}


def test_an_empty_prompt_counts_zero():
    body = orjson.dumps({"input_ids": [], "pad": "]" * (COUNT_IDS_ABOVE + 1)})
    assert parse_generate(body) == ({"input_ids": [], "pad": "]" * (COUNT_IDS_ABOVE + 1)}, 0)


def test_ids_are_parsed_when_their_logprobs_are_asked_for():
    ids = list(range(30_000))
    body = _body(ids, logprob_start_len=29_990, sampling_params={"max_new_tokens": 0})
    req, count = parse_generate(body)
    assert count == 30_000 and req["input_ids"] == ids


def test_short_bodies_and_bodies_without_ids_are_parsed_whole():
    short = orjson.dumps({"input_ids": [5, 6, 7], "rid": "x"})
    assert parse_generate(short) == (orjson.loads(short), 3)
    text = orjson.dumps({"text": "y" * (COUNT_IDS_ABOVE + 1)})
    assert parse_generate(text) == (orjson.loads(text), 0)


def test_the_stand_in_reports_a_counted_prompt_as_its_prompt_tokens():
    app = make_app({"out_ids": [11, 12, 13], "stop_id": 2, "tool_call": {"name": "f", "arguments": "{}"}})
    body = _body(list(range(100_000)), sampling_params={"max_new_tokens": 8})

    async def post():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://standin") as c:
            return (await c.post("/generate", content=body)).json()

    reply = asyncio.run(post())
    assert reply["meta_info"]["prompt_tokens"] == 100_000
    assert reply["output_ids"] == [11, 12, 13]
