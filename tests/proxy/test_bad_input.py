"""Whatever a client sends, the answer is a 2xx or an OpenAI-shaped 4xx, and stored sessions stay intact."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fakes.engines import FixedPool
from proxy.app import create_app
from proxy.settings import Settings
from tokenization import ChatFormat, load_tokenizer, qwen3_tokenizer_dir


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    tok = load_tokenizer(str(qwen3_tokenizer_dir()))
    ids = tok.encode("ok<|im_end|>", add_special_tokens=False)
    store = str(tmp_path_factory.mktemp("store") / "s.sqlite")
    app = create_app(Settings(store=store, max_context=4096), fmt=ChatFormat(tok, "qwen3"), pool=FixedPool(ids))
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 10**12) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)
roles = st.sampled_from(["system", "developer", "user", "assistant", "tool", "function", "bogus", None, 3])
messages = st.lists(
    st.fixed_dictionaries({"role": roles}, optional={"content": json_values, "tool_calls": json_values,
                                                     "tool_call_id": json_values, "name": json_values}),
    max_size=4,
)
chat_bodies = st.fixed_dictionaries(
    {"messages": messages | json_values},
    optional={"model": json_values, "tools": json_values, "max_tokens": json_values, "stream": st.booleans(),
              "temperature": json_values, "stop": json_values, "n": json_values},
)
responses_bodies = st.fixed_dictionaries(
    {"input": json_values | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "x"])},
                                                           optional={"role": roles, "content": json_values, "call_id": json_values,
                                                                     "name": json_values, "arguments": json_values, "output": json_values}), max_size=4)},
    optional={"instructions": json_values, "tools": json_values, "previous_response_id": json_values,
              "max_output_tokens": json_values, "stream": st.booleans()},
)


def _check(r):
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"]
        assert "type" in err and "code" in err


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=chat_bodies)
def test_chat_never_500(client, body):
    _check(client.post("/v1/chat/completions", json=body))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=responses_bodies)
def test_responses_never_500(client, body):
    _check(client.post("/v1/responses", json=body))


@pytest.mark.parametrize("raw", [b"", b"{", b"[]", b"null", b'{"messages": "x"}', b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN, "max_tokens": Infinity}', b"\xff\xfe", b'{"messages": [{"role": "user", "content": "' + b"a" * 10000 + b'"}]}'])
def test_raw_bodies(client, raw):
    _check(client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"}))
    _check(client.post("/v1/responses", content=raw, headers={"content-type": "application/json"}))


def test_bad_requests_leave_a_session_intact(client):
    h = {"X-Session-Id": "keep"}
    ok = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}, headers=h)
    assert ok.status_code == 200
    before = client.get("/v1/sessions/keep").json()
    for body in ({"messages": [{"role": "user", "content": {"x": 1}}]}, {"messages": [{"role": "tool"}]}, {"messages": []}):
        _check(client.post("/v1/chat/completions", json=body, headers=h))
    assert client.get("/v1/sessions/keep").json()["turns"] == before["turns"]
