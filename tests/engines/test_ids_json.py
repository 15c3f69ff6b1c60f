"""A session's long prompt is written as JSON once and extended after: the bytes must always be
those of the ids themselves (the reference: ``json.loads`` of the body against the array)."""

from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import orjson
import pytest
import respx
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.http_transport import EngineTransport
from engines.ids_json import MAX_PIECES, IdsJson
from engines.json_body import JsonPieces, content_bytes, content_length, encode_body
from engines.sglang import SGLangClient
from engines.types import SamplingParams
from tokenization import id_chain


def _body_ids(value) -> list[int]:
    return json.loads(content_bytes(encode_body({"input_ids": value})))["input_ids"]  # as Http sends it


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(["a", "b"]), st.sampled_from(["extend", "same", "new", "shorter", "edit"]),
                                st.integers(0, 40), st.booleans()), min_size=1, max_size=12),
       dtype=st.sampled_from([np.int32, np.int64]))  # fmt: skip
def test_every_body_holds_exactly_the_prompt(steps, dtype):
    """Arrays of the caller's own, and (int32) views of id chains as the proxy sends them: an
    extension appended in place, the same view again, a shorter view, a sibling's copy."""
    enc = IdsJson(min_ids=8, max_bytes=4096)  # small: eviction happens along the way too
    last: dict[str, np.ndarray] = {}
    rng = np.random.default_rng(len(steps))
    for key, how, n, chain in steps:
        chain = chain and dtype == np.int32
        prev = last.get(key, rng.integers(0, 151_000, 10, dtype=dtype))
        if how == "extend":
            tail = rng.integers(0, 151_000, n, dtype=dtype)
            ids = id_chain.join(prev, tail) if chain else np.concatenate([prev, tail])
        elif how == "same":
            ids = prev if chain else prev.copy()
        elif how == "shorter":
            ids = prev[: max(1, prev.size - n)]
            ids = ids if chain else ids.copy()
        elif how == "edit":  # same length, one id changed inside the old prefix
            ids = prev.copy()
            ids[n % ids.size] = (ids[n % ids.size] + 1) % 151_000
        else:
            ids = rng.integers(0, 151_000, 8 + n, dtype=dtype)
        ids = ids if chain and how != "edit" else ids.astype(dtype)
        if chain and how in ("new", "edit"):
            ids = id_chain.join(ids)
        assert _body_ids(enc(key, ids)) == ids.tolist()
        last[key] = ids


def test_an_extended_prompt_reuses_the_previous_json_and_a_changed_array_does_not_fool_it():
    enc = IdsJson(min_ids=4)
    ids = np.arange(10, dtype=np.int32)
    assert _body_ids(enc("s", ids)) == list(range(10)) and enc.reused == 0
    longer = np.concatenate([ids, np.array([7, 8], dtype=np.int32)])
    assert _body_ids(enc("s", longer)) == [*range(10), 7, 8] and enc.reused == 1
    longer[0] = 99  # the caller changes its array in place, then sends it again
    assert _body_ids(enc("s", longer)) == [99, *range(1, 10), 7, 8]
    assert _body_ids(enc(None, longer)) == longer.tolist()  # no session key: written as it is
    assert enc("s", [1, 2, 3, 4, 5]) == [1, 2, 3, 4, 5]  # a list (not an array) is written as it is


def test_a_long_session_keeps_its_json_in_few_pieces_and_its_ids_in_one_growing_buffer():
    enc = IdsJson(min_ids=4)
    ids = np.arange(100, dtype=np.int32)
    for turn in range(3 * MAX_PIECES):
        ids = np.concatenate([ids, np.array([turn % 7, 198], dtype=np.int32)])
        out = enc("s", ids)
        assert type(out) is JsonPieces and len(out) <= MAX_PIECES + 2
        assert _body_ids(out) == ids.tolist()
    kept = enc._last["s"]
    assert enc.reused == 3 * MAX_PIECES - 1 and kept.n == ids.size and kept.buf.size < 2 * ids.size
    assert enc._bytes == kept.buf.nbytes + sum(len(p) for p in kept.pieces)


@given(body=st.dictionaries(st.sampled_from(["a", "b\"q", "c", "é"]),
                            st.one_of(st.integers(-2**63, 2**63 - 1), st.text(max_size=5), st.lists(st.integers(-99, 99), max_size=3)), max_size=3),
       at=st.sampled_from(["a", "z", "\n"]), ids=st.lists(st.integers(-5, 10**6), min_size=1, max_size=20))  # fmt: skip
def test_a_body_with_pieces_is_the_json_of_the_same_body(body, at, ids):
    """The reference: ``json.loads`` of the pieces sent back to back equals the body as a dict."""
    text = json.dumps(ids, separators=(",", ":")).encode()
    pieces = JsonPieces((text[:1], text[1:3], text[3:])) if len(text) > 3 else JsonPieces((text,))
    content = encode_body({**body, at: pieces})
    assert isinstance(content, list) and content_length(content) == len(content_bytes(content))
    assert json.loads(content_bytes(content)) == {**body, at: ids}
    assert encode_body(body) == orjson.dumps(body)  # no pieces: one buffer, as before


def test_memory_stays_under_its_bound():
    enc = IdsJson(min_ids=4, max_bytes=10_000)
    for k in range(100):
        enc(f"s{k}", np.arange(200, dtype=np.int64))
    assert enc._bytes <= 10_000 and 0 < len(enc._last) < 100


def test_sglang_wire_carries_the_exact_ids_turn_after_turn():
    """Two turns of one session against an SGLang-shaped reply: each /generate body holds the
    turn's exact prompt, and the second was written by extending the first."""
    url = "http://sglang-ids:30000"
    prompt = np.arange(5000, dtype=np.int32) % 1500
    reply = {"text": "", "output_ids": [5], "meta_info": {"finish_reason": {"type": "stop", "matched": 5},
             "output_token_logprobs": [[-0.1, 5, None]], "prompt_tokens": 0, "completion_tokens": 1}}  # fmt: skip

    async def go():
        with respx.mock() as router:
            route = router.post(url + "/generate").mock(return_value=httpx.Response(200, json=reply))
            async with httpx.AsyncClient(transport=EngineTransport()) as http:
                client = SGLangClient(http, url)
                await client.generate(prompt, SamplingParams(max_new_tokens=1), rid="r1", routing_key="sess")
                second = np.concatenate([prompt, np.array([5, 198, 42], dtype=np.int32)])
                await client.generate(second, SamplingParams(max_new_tokens=1), rid="r2", routing_key="sess")
            bodies = [json.loads(call.request.content) for call in route.calls]
            return client, second, bodies

    client, second, bodies = asyncio.run(go())
    assert [b["input_ids"] for b in bodies] == [prompt.tolist(), second.tolist()]
    assert client.ids_json.reused == 1


def test_vllm_wire_carries_the_exact_ids_turn_after_turn():
    """The same on vLLM's ``/v1/completions``: each body's ``prompt`` is the turn's exact ids."""
    from tests.fakes.engines import Step, vllm_reply
    from engines.vllm import VLLMClient

    url = "http://vllm-ids:8000"
    prompt = np.arange(6000, dtype=np.int32) % 1700
    second = np.concatenate([prompt, np.array([11, 198, 7], dtype=np.int32)])

    async def go():
        with respx.mock() as router:
            route = router.post(url + "/v1/completions").mock(
                side_effect=[httpx.Response(200, json=vllm_reply(p.tolist(), Step([(11, -0.5)], finish="length")))
                             for p in (prompt, second)]
            )  # fmt: skip
            async with httpx.AsyncClient(transport=EngineTransport()) as http:
                client = VLLMClient(http, url, model="tiny")
                for p in (prompt, second):
                    await client.generate(p, SamplingParams(max_new_tokens=1), rid="r", routing_key="sess")
            return client, [json.loads(call.request.content) for call in route.calls]

    client, bodies = asyncio.run(go())
    assert [b["prompt"] for b in bodies] == [prompt.tolist(), second.tolist()]
    assert client.ids_json.reused == 1


def test_a_spliced_prompt_on_an_id_chain_is_kept_as_it_is_and_known_to_extend_it(monkeypatch):
    """The proxy's prompts are views of one id chain (tokenization/id_chain.py): the kept ids are
    the prompt itself (no copy), and a next prompt that starts where it did extends it by
    construction, so nothing is compared."""
    enc = IdsJson(min_ids=4)
    prompt = id_chain.join(np.arange(5000, dtype=np.int32) % 1500)
    enc("s", prompt)
    kept = enc._last["s"]
    assert kept.ref is prompt and kept.buf is None
    full = id_chain.join(prompt, [5, 6])
    nxt = id_chain.join(full[:5000], full[5000:], [198, 42])  # the next turn: prompt + output + bridge
    with monkeypatch.context() as m:
        m.setattr(np, "array_equal", lambda *a, **k: pytest.fail("the kept ids were compared"))
        body = enc("s", nxt)
    assert _body_ids(body) == nxt.tolist() and enc.reused == 1
    assert enc._bytes == sum(len(p) for p in kept.pieces)  # the chain's ids are the turns' (the store counts them)
    sibling = id_chain.join(full[:5000], full[5000:], [7])  # a copy: not known, and not a prefix
    assert _body_ids(enc("s", sibling)) == sibling.tolist() and enc.reused == 1
    resumed = np.concatenate([sibling, [9, 9]]).astype(np.int32)  # not a chain: compared, then copied
    assert _body_ids(enc("s", resumed)) == resumed.tolist() and enc.reused == 2
    assert enc._last["s"].ref is None and enc._last["s"].n == resumed.size


def test_the_default_budget_keeps_forty_interleaved_100k_sessions():
    """30 agents of 100k tokens beside 30 of 10k thrashed a 32 MiB budget: every turn wrote its
    whole prompt as JSON again."""
    enc = IdsJson()
    rng = np.random.default_rng(1)
    prompts = {s: rng.integers(0, 150_000, 100_000, dtype=np.int32) for s in range(40)}
    for s, ids in prompts.items():
        enc(f"s{s}", ids)
    for s, ids in prompts.items():
        prompts[s] = np.concatenate([ids, rng.integers(0, 150_000, 50, dtype=np.int32)])
        body = enc(f"s{s}", prompts[s])
        assert orjson.loads(b"".join(body)) == prompts[s].tolist()
    assert enc.reused == 40
