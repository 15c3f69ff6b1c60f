"""Each input that used to produce a 5xx (or worse) is now a 4xx in the API's shape before any
work, or a clear engine error; nothing is stored for a refused request."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import orjson
import pytest
from fastapi.testclient import TestClient

from proxy.app import create_app
from proxy.settings import Settings
from tests.fakes.engines import FixedPool
from tokenization import ChatFormat, load_tokenizer, qwen3_tokenizer_dir

TOK = load_tokenizer(str(qwen3_tokenizer_dir()))
OK_IDS = TOK.encode("ok<|im_end|>", add_special_tokens=False)


class CountingPool(FixedPool):
    """``FixedPool`` that counts engine calls and can answer with chosen ids."""

    def __init__(self, ids):
        super().__init__(ids)
        self.calls = 0

    async def generate(self, input_ids, params, *, session_id, on_tokens=None):
        self.calls += 1
        return await super().generate(input_ids, params, session_id=session_id, on_tokens=on_tokens)


def make_client(tmp_path, pool=None, **settings):
    pool = pool or CountingPool(OK_IDS)
    kw = dict(store=str(tmp_path / "s.sqlite"), max_context=4096)
    kw.update(settings)
    app = create_app(Settings(**kw), fmt=ChatFormat(TOK, "qwen3"), pool=pool)
    return TestClient(app, raise_server_exceptions=False), pool, app


@pytest.fixture
def client(tmp_path):
    c, pool, app = make_client(tmp_path)
    with c:
        c.pool = pool
        c.app_ = app
        yield c


def assert_error(r, status=400, code=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and "type" in err and "code" in err
    if code is not None:
        assert err["code"] == code, err


def chat(content, **extra):
    return {"messages": [{"role": "user", "content": content}], **extra}


def nested(depth: int):
    v: object = 1
    for _ in range(depth):
        v = [v]
    return v


def no_turns(client) -> bool:
    return client.app_.state.store.stats()["turns"] == 0


# ---------------------------------------------------------------- types the conversions did not expect


@pytest.mark.parametrize("typ", [{"a": 1}, ["text"], 3, None])
def test_content_part_type_of_any_json_type_is_a_400(client, typ):
    assert_error(client.post("/v1/chat/completions", json=chat([{"type": typ, "text": "hi"}])))
    body = {"input": [{"type": "message", "role": "user", "content": [{"type": typ, "text": "hi"}]}]}
    assert_error(client.post("/v1/responses", json=body))
    assert client.pool.calls == 0 and no_turns(client)


@pytest.mark.parametrize("choice", [{"type": "function", "function": "f"}, {"type": "function", "function": ["f"]}, {"type": {"x": 1}}])
def test_tool_choice_function_as_a_string_is_a_400(client, choice):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert_error(client.post("/v1/chat/completions", json=chat("hi", tools=tools, tool_choice=choice)))
    rtools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    assert_error(client.post("/v1/responses", json={"input": "hi", "tools": rtools, "tool_choice": choice}))
    assert client.pool.calls == 0


@pytest.mark.parametrize("summary", [[{"type": "summary_text", "text": {"a": 1}}], [{"text": [1, 2]}], [{"text": 5}]])
def test_non_string_reasoning_summary_is_a_400(client, summary):
    items = [
        {"type": "message", "role": "user", "content": "hi"},
        {"type": "reasoning", "summary": summary},
        {"type": "message", "role": "assistant", "content": "ok"},
        {"type": "message", "role": "user", "content": "again"},
    ]
    r = client.post("/v1/responses", json={"input": items})
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert_error(r)


# ---------------------------------------------------------------- integers


@pytest.mark.parametrize("size", [str(2**70), str(2**63), "1e30", "-1", "0"])
def test_group_size_out_of_range_is_a_400(client, size):
    assert_error(client.post("/v1/chat/completions", json=chat("hi"), headers={"X-Group-Size": size}))
    r = client.post("/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "hi"}], "metadata": {"group_size": ' + size.encode() + b"}}",
                    headers={"content-type": "application/json"})
    assert_error(r)
    assert client.pool.calls == 0 and no_turns(client)


@pytest.mark.parametrize("version", [2**64, 2**63, 2**31, -1, 1.5, "3", True])
def test_admin_version_out_of_range_is_refused_and_health_stays_up(client, version):
    assert_error(client.post("/admin/version", json={"version": version}))
    assert client.get("/health").status_code == 200
    assert client.get("/admin/status").status_code == 200
    assert client.post("/admin/version", json={"version": 7}).json()["version"] == 7
    assert client.get("/health").json()["version"] == 7


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_token_budget_beyond_int32_is_a_400(client, field):
    assert_error(client.post("/v1/chat/completions", json=chat("hi", **{field: 2**31})))
    assert_error(client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2**40}))
    assert client.pool.calls == 0


@pytest.mark.parametrize("reward", ["1.5", True, None, [1.0], {"v": 1}, 1e200, -1e200, 1e6 + 1])
def test_reward_must_be_a_json_number(client, reward):
    h = {"X-Session-Id": "rw"}
    assert client.post("/v1/chat/completions", json=chat("hi"), headers=h).status_code == 200
    assert_error(client.post("/v1/sessions/rw/reward", json={"reward": reward}))
    assert client.get("/v1/sessions/rw").json()["reward"] is None
    r = client.post("/v1/sessions/rw/reward", json={"reward": 1})  # an integer is a number
    assert r.status_code == 200 and r.json()["reward"] == 1.0


# ---------------------------------------------------------------- depth


@pytest.mark.parametrize("depth", [65, 254, 300, 1000])
@pytest.mark.parametrize("where", ["metadata", "text", "tool_params", "stream"])
def test_deep_json_is_a_400_before_generation(client, depth, where):
    deep = nested(depth)
    if where == "metadata":
        body = chat("hi", metadata={"x": deep})
    elif where == "text":
        body = {"input": "hi", "text": {"format": {"type": "json_schema", "schema": deep}}}
    elif where == "tool_params":
        body = chat("hi", tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "x": deep}}}])
    else:
        body = {"input": "hi", "stream": True, "metadata": {"x": deep}}
    path = "/v1/responses" if where in ("text", "stream") else "/v1/chat/completions"
    r = client.post(path, content=orjson.dumps(body) if depth < 250 else _dumps_deep(body), headers={"content-type": "application/json"})
    assert_error(r)
    assert "nested" in r.json()["error"]["message"]
    assert client.pool.calls == 0 and no_turns(client)


def _dumps_deep(obj) -> bytes:
    """JSON for structures deeper than orjson writes (255 levels)."""
    import json
    import sys

    old = sys.getrecursionlimit()
    sys.setrecursionlimit(10_000)
    try:
        return json.dumps(obj).encode()
    finally:
        sys.setrecursionlimit(old)


def test_depth_within_the_limit_is_served(client):
    r = client.post("/v1/chat/completions", json=chat("hi", metadata={"x": nested(40)}))
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------- routes, shapes, schema


def test_unknown_routes_and_methods_have_the_error_shape(client):
    assert_error(client.get("/v1/nope"), 404)
    assert_error(client.post("/nope", json={}), 404)
    assert_error(client.get("/v1/chat/completions"), 405)
    assert_error(client.delete("/v1/responses"), 405)


def test_openapi_documents_every_request_body(client):
    doc = client.get("/openapi.json").json()
    routes = ["/v1/responses", "/v1/chat/completions", "/v1/sessions/{session_id}/reward", "/v1/trajectories/pull",
              "/v1/trajectories/ack", "/admin/update_weights", "/admin/version"]
    for path in routes:
        schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert schema.get("properties"), path
    reward = doc["paths"]["/v1/sessions/{session_id}/reward"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert reward["required"] == ["reward"]
    import re

    for ref in re.findall(r'"\$ref":"#/components/schemas/([^"]+)"', orjson.dumps(doc).decode()):
        assert ref in doc["components"]["schemas"], ref  # nothing dangles


def test_an_unexpected_exception_is_a_shaped_500_and_never_reaches_the_server(tmp_path, caplog):
    c, pool, app = make_client(tmp_path)

    @app.get("/boom")
    async def boom():
        raise RuntimeError("kaput http://user:hunter2@engine:1/")

    with c:
        caplog.set_level(logging.INFO)
        r = c.get("/boom")
        assert_error(r, 500, "internal_error")
        assert "hunter2" not in r.text
        errors = [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
        assert len(errors) == 1 and "/boom" in errors[0].getMessage(), [rec.getMessage() for rec in errors]  # logged once
        assert c.get("/health").status_code == 200
        assert 'splice_requests_total{route="other",status="500"} 1.0' in c.get("/metrics").text


# ---------------------------------------------------------------- engine ids


class IdsPool(CountingPool):
    pass


@pytest.mark.parametrize("bad", [-1, 2**40, 2**31, 10_000_000])
@pytest.mark.parametrize("stream", [False, True])
def test_engine_token_id_outside_the_vocabulary_is_a_502(tmp_path, bad, stream):
    c, pool, app = make_client(tmp_path, pool=IdsPool([OK_IDS[0], bad, OK_IDS[-1]]))
    with c:
        r = c.post("/v1/chat/completions", json=chat("hi", stream=stream))
        assert_error(r, 502, "engine_bad_response")
        assert "vocabulary" in r.json()["error"]["message"]
        r = c.post("/v1/responses", json={"input": "hi", "stream": stream})
        assert_error(r, 502)
        assert app.state.store.stats()["turns"] == 0
        assert c.get("/health").status_code == 200


# ---------------------------------------------------------------- large inputs


def test_huge_message_is_context_length_exceeded_without_tokenizing(client, monkeypatch):
    import proxy.session.runner as runner_module

    planned = []  # planning is where a prompt is rendered and tokenized (10 MB took 7-10 s)
    real_plan = runner_module.plan
    monkeypatch.setattr(runner_module, "plan", lambda *a, **kw: planned.append(1) or real_plan(*a, **kw))
    big = "a " * 5_000_000  # 10 MB: far more than 4096 tokens can hold
    r = client.post("/v1/chat/completions", json=chat(big))
    assert_error(r, 400, "context_length_exceeded")
    r = client.post("/v1/responses", json={"input": big})
    assert_error(r, 400, "context_length_exceeded")
    assert planned == [] and client.pool.calls == 0
    r = client.post("/v1/chat/completions", json=chat("hi"))  # the spy sees a turn that is planned
    assert r.status_code == 200 and planned == [1]


def test_large_request_is_planned_off_the_event_loop(tmp_path):
    """A request that must be tokenized in full runs in a worker thread, and the tokenizer lets
    go of the GIL meanwhile: /health keeps answering."""
    asyncio.run(_large_request(tmp_path))


async def _large_request(tmp_path):
    pool = CountingPool(OK_IDS)
    app = create_app(Settings(store=str(tmp_path / "s.sqlite"), max_context=2_000_000), fmt=ChatFormat(TOK, "qwen3"), pool=pool)
    text = " ".join(f"word{i}" for i in range(250_000))  # ~2 MB, ~750k tokens to render
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as c:
        start = time.perf_counter()
        big = asyncio.create_task(c.post("/v1/chat/completions", json=chat(text, max_tokens=4)))
        worst, polls = 0.0, 0
        while not big.done():
            t0 = time.perf_counter()
            assert (await c.get("/health")).status_code == 200
            worst, polls = max(worst, time.perf_counter() - t0), polls + 1
            await asyncio.sleep(0.02)
        r = await big
        total = time.perf_counter() - start
    assert r.status_code == 200, r.text
    # planned on the loop, one /health would wait for the whole request; relative, so a loaded
    # machine (slower everything) does not decide it
    # The tokenizer releases the GIL on long text: /health is answered every ~25 ms all along
    # (about 110 polls in 2.5 s here). Holding it, 3 or 4 polls got through in the whole request.
    assert polls >= 25 and worst < 0.5 * total, (polls, worst, total)


class PromptPool(CountingPool):
    """``CountingPool`` that keeps each turn's prompt ids."""

    def __init__(self, ids):
        super().__init__(ids)
        self.prompts: list[list[int]] = []

    async def generate(self, input_ids, params, *, session_id, on_tokens=None):
        self.prompts.append([int(t) for t in input_ids])
        return await super().generate(input_ids, params, session_id=session_id, on_tokens=on_tokens)


def test_splice_onto_a_long_history_is_planned_inline_a_render_is_not(tmp_path, monkeypatch):
    """A long conversation's first turn (a full render) and long new messages are tokenized in a
    worker thread; a splice onto the long recorded history, which tokenizes only the short new
    message, is planned on the event loop's thread (a thread hand-off per turn cost a 100k-token
    turn as much as its plan). The spliced prompt is the template's own rendering."""
    import threading

    import proxy.session.runner as runner_module

    where: list[str] = []
    real_plan = runner_module.plan

    def spy(*a, **kw):
        p = real_plan(*a, **kw)  # recorded only once a plan is made (an inline try may defer)
        where.append("loop" if threading.get_ident() == loop_thread else "worker")
        return p

    monkeypatch.setattr(runner_module, "plan", spy)
    long_text = " ".join(f"word{i}" for i in range(8_000))  # ~70k characters, over PLAN_INLINE_CHARS
    assert len(long_text) > runner_module.PLAN_INLINE_CHARS
    c, pool, app = make_client(tmp_path, pool=PromptPool(OK_IDS), max_context=200_000)
    with c:
        loop_thread = c.portal.call(threading.get_ident)
        msgs = [{"role": "user", "content": long_text}]
        for new in ("and now?", "then?", long_text[::-1], None):  # the last new message is long too
            r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 8})
            assert r.status_code == 200, r.text
            if new is not None:
                msgs = msgs + [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                               {"role": "user", "content": new}]  # fmt: skip
        store = app.state.store
        turns = store.turns.list(store.sessions.list().sessions[0]["session_id"])
    assert where == ["worker", "loop", "loop", "worker"]
    assert [t.spliced for t in turns] == [False, True, True, True]
    # the third request (two short splices in): its prompt as the model's own template renders it
    want = TOK.apply_chat_template(msgs[:5], tokenize=True, add_generation_prompt=True, return_dict=False)
    assert pool.prompts[2] == list(want)


def test_the_vocabulary_scan_runs_at_start_up_once_per_tokenizer():
    """The most characters one token stands for (a pass over the whole vocabulary, ~0.1 s) is
    computed in the background from start-up, once per tokenizer: the first long turn of a
    session used to pay it on the event loop, mid-run."""
    from proxy.session.runner import max_token_chars, max_token_chars_soon

    soon = max_token_chars_soon(TOK)
    assert max_token_chars_soon(TOK) is soon  # shared by every app on this tokenizer
    longest = max(len(p) for p in TOK.convert_ids_to_tokens(list(range(len(TOK)))) if p)
    assert soon.result(timeout=60) == max_token_chars(TOK) == longest > 1
