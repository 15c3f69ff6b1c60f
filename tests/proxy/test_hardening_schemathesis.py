"""Schemathesis against the in-process app (every agent and trainer route, from /openapi.json):
no 5xx, and every 4xx in OpenAI's error shape. A fixed engine pool answers every turn, so no
model runs. Positive and negative examples, bounded so the run takes seconds."""

from __future__ import annotations

import tempfile
from collections import Counter
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode

from proxy.app import create_app
from proxy.settings import Settings
from proxy.store import Store
from tests.fakes.engines import FixedPool
from tokenization import ChatFormat, load_tokenizer, qwen3_tokenizer_dir

_TOK = load_tokenizer(str(qwen3_tokenizer_dir()))
_PATH = str(Path(tempfile.mkdtemp(prefix="splice-schemathesis-")) / "s.sqlite")
_STORE = Store(_PATH)
_STORE.close = lambda: None  # the ASGI client runs the app's lifespan around every call
APP = create_app(
    Settings(store=_PATH, max_context=4096, admin_token=None, api_key=None),
    fmt=ChatFormat(_TOK, "qwen3"),
    pool=FixedPool(_TOK.encode("ok<|im_end|>", add_special_tokens=False)),
    store=_STORE,
)
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)
schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])

SEEN: Counter = Counter()
AGENT_AND_TRAINER_ROUTES = {
    ("POST", "/v1/responses"),
    ("GET", "/v1/responses/{response_id}"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/sessions/{session_id}"),
    ("POST", "/v1/sessions/{session_id}/reward"),
    ("POST", "/v1/trajectories/pull"),
    ("POST", "/v1/trajectories/ack"),
    ("POST", "/admin/update_weights"),
    ("POST", "/admin/version"),
}


def check_error_shape(response, path: str = "") -> None:
    """No 5xx; a 4xx in OpenAI's ``{"error": {message, type, code}}`` or, on the Anthropic
    Messages API, Anthropic's ``{"type": "error", "error": {type, message}}``."""
    assert response.status_code < 500, f"{response.status_code}: {response.text[:500]}"
    if response.status_code >= 400:
        body = response.json()
        assert isinstance(body, dict) and isinstance(body.get("error"), dict), response.text[:300]
        err = body["error"]
        assert isinstance(err.get("message"), str) and err["message"], response.text[:300]
        assert isinstance(err.get("type"), str), response.text[:300]
        openai = "code" in err
        anthropic = path.startswith("/v1/messages") and body.get("type") == "error"
        assert openai or anthropic, response.text[:300]


def test_schema_covers_every_agent_and_trainer_route():
    ops = {(op.method.upper(), op.path) for op in (r.ok() for r in schema.get_all_operations())}
    assert AGENT_AND_TRAINER_ROUTES <= ops
    doc = APP.openapi()
    for method, path in AGENT_AND_TRAINER_ROUTES:
        if method == "POST" and not path.endswith(("/pause", "/resume")):
            body = doc["paths"][path]["post"].get("requestBody")
            assert body and body["content"]["application/json"]["schema"]["properties"], path


@schema.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_api(case):
    # /admin/pause and /admin/resume would pause the fixed pool (no-ops, but keep them honest too)
    if case.path == "/v1/trajectories/pull" and isinstance(case.body, dict):
        if isinstance(case.body.get("wait_s"), (int, float)) and not isinstance(case.body["wait_s"], bool):
            case.body["wait_s"] = min(case.body["wait_s"], 0.05)  # a legal long poll would only slow the run
    response = case.call()
    SEEN[case.operation.label] += 1
    check_error_shape(response, case.path)


def test_report_case_count():
    """Runs last in this module: how many cases schemathesis sent (printed with -s)."""
    total = sum(SEEN.values())
    print(f"\nschemathesis: {total} cases over {len(SEEN)} operations")
    if SEEN:
        assert total >= 100
    else:
        pytest.skip("test_api did not run in this session")
