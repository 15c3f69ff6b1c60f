"""A finished turn is freed by reference counting: it leaves no reference cycle behind for the
cycle collector, whose full passes over a busy proxy's garbage cost tens of milliseconds each
(a tail-latency spike every few hundred turns)."""

from __future__ import annotations

import gc

import httpx
import pytest

from proxy.api.context import DialectContext
from proxy.app import create_app
from proxy.session.turn import TurnRequest, TurnResult
from proxy.settings import Settings
from tests.fakes.engines import FixedPool
from tests.fakes.serve import serve_in_thread
from tokenization import ChatFormat, load_tokenizer, qwen3_tokenizer_dir

TURN_TYPES = (TurnRequest, TurnResult, DialectContext)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    """The app under uvicorn in this process (the collector's garbage is per process), served
    on loopback from a thread; a test client's own machinery would leave cycles of its own."""
    tok = load_tokenizer(str(qwen3_tokenizer_dir()))
    ids = tok.encode("ok<|im_end|>", add_special_tokens=False)
    store = str(tmp_path_factory.mktemp("store") / "s.sqlite")
    app = create_app(Settings(store=store, max_context=4096), fmt=ChatFormat(tok, "qwen3"), pool=FixedPool(ids))
    base, stop = serve_in_thread(app, timeout_s=60)
    with httpx.Client(base_url=base, timeout=30) as c:
        yield c
    stop()


def _chat(c, stream):
    msgs = [{"role": "user", "content": "hi"}]
    for _ in range(3):
        r = c.post("/v1/chat/completions", json={"model": "m", "messages": msgs, "stream": stream})
        assert r.status_code == 200, r.text
        if not stream:
            msgs += [r.json()["choices"][0]["message"], {"role": "user", "content": "more"}]


def _responses(c, stream):
    prev = None
    for _ in range(3):
        body = {"model": "m", "input": "hi", "stream": stream, **({"previous_response_id": prev} if prev else {})}
        r = c.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        prev = None if stream else r.json()["id"]


def _messages(c, stream):
    r = c.post("/v1/messages", json={"model": "m", "max_tokens": 16, "stream": stream, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", [_chat, _responses, _messages])
def test_turns_leave_no_reference_cycles(client, api, stream):
    api(client, stream)  # warm: lazily built state is not per-turn garbage
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        api(client, stream)
        gc.collect()
        cyclic = [type(o).__name__ for o in gc.garbage if isinstance(o, TURN_TYPES)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert cyclic == [], f"turn objects left in reference cycles: {sorted(set(cyclic))}"
