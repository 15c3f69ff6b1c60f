"""A ``<tool_call>`` naming a tool the request did not declare (or any call when it declared none)
comes back as text, flagged like a malformed call, in every dialect; the recorded output ids
keep exactly what the engine sampled. Real parts: the reference engine (script mode) over
HTTP, the proxy app, the real Qwen3 tokenizer."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

CALL_LS = '<tool_call>\n{"name": "ls", "arguments": {"path": "."}}\n</tool_call>'
CALL_SHELL = '<tool_call>\n{"name": "shell", "arguments": {"cmd": "pwd"}}\n</tool_call>'
SCRIPT = [
    f"Listing.\n{CALL_LS}<|im_end|>",  # chat, tools [shell]: ls is undeclared
    f"{CALL_SHELL}\n{CALL_LS}<|im_end|>",  # chat, tools [shell]: one good call, one undeclared
    f"{CALL_SHELL}<|im_end|>",  # chat, no tools at all
    f"{CALL_LS}<|im_end|>",  # responses, tools [shell]
    f"{CALL_LS}<|im_end|>",  # messages, tools [shell]
]
SHELL = {"type": "function", "function": {"name": "shell", "description": "Run.", "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    from engines.pool import EnginePool
    from engines.reference.model_init import init_model
    from engines.reference.testing import start_engine_in_thread
    from proxy.app import create_app
    from proxy.settings import Settings
    from tokenization import ChatFormat, load_tokenizer

    tmp = tmp_path_factory.mktemp("undeclared")
    model = init_model(tmp / "model", max_position_embeddings=4096)
    url, stop = start_engine_in_thread(model, script=SCRIPT)
    tok = load_tokenizer(str(model))
    app = create_app(Settings(store=str(tmp / "s.sqlite")), fmt=ChatFormat(tok, "qwen3"), pool=EnginePool("sglang", [url], health_interval_s=0))
    try:
        with TestClient(app) as c:
            yield c, tok
    finally:
        stop()


def _as_text(call: str) -> str:
    """How a call returned as text reads (as a malformed call does: the tags and the JSON)."""
    return call.replace("\n", "")


def _recorded_text(c, tok, session: str) -> str:
    turns = c.get(f"/v1/sessions/{session}").json()["turns"]
    return tok.decode(turns[-1]["output_ids"])


def test_undeclared_calls_are_text_and_flagged(proxy):
    c, tok = proxy
    msgs = [{"role": "user", "content": "list files"}]

    r = c.post("/v1/chat/completions", json={"messages": msgs, "tools": [SHELL]}, headers={"X-Session-Id": "u1"}).json()
    msg = r["choices"][0]["message"]
    assert not msg.get("tool_calls") and r["choices"][0]["finish_reason"] == "stop"
    assert _as_text(CALL_LS) in msg["content"] and msg["content"].startswith("Listing.")
    assert r["splice"]["malformed_tool_calls"] == 1
    assert _recorded_text(c, tok, "u1") == f"Listing.\n{CALL_LS}<|im_end|>"  # the ids keep what was sampled

    r = c.post("/v1/chat/completions", json={"messages": msgs, "tools": [SHELL]}, headers={"X-Session-Id": "u2"}).json()
    msg = r["choices"][0]["message"]
    assert [tc["function"]["name"] for tc in msg["tool_calls"]] == ["shell"]  # the declared call survives
    assert _as_text(CALL_LS) in msg["content"] and r["choices"][0]["finish_reason"] == "tool_calls"
    assert r["splice"]["malformed_tool_calls"] == 1

    r = c.post("/v1/chat/completions", json={"messages": msgs}, headers={"X-Session-Id": "u3"}).json()
    msg = r["choices"][0]["message"]
    assert not msg.get("tool_calls") and _as_text(CALL_SHELL) in msg["content"]
    assert r["splice"]["malformed_tool_calls"] == 1
    assert _recorded_text(c, tok, "u3") == f"{CALL_SHELL}<|im_end|>"

    flat = {"type": "function", **SHELL["function"]}
    r = c.post("/v1/responses", json={"input": "list files", "tools": [flat]}, headers={"X-Session-Id": "u4"}).json()
    assert [o["type"] for o in r["output"]] == ["message"]
    assert _as_text(CALL_LS) in r["output"][0]["content"][0]["text"]
    assert r["splice"]["malformed_tool_calls"] == 1

    anth = {"name": "shell", "description": "Run.", "input_schema": SHELL["function"]["parameters"]}
    r = c.post("/v1/messages", json={"max_tokens": 200, "messages": msgs, "tools": [anth]}, headers={"X-Session-Id": "u5"}).json()
    assert [b["type"] for b in r["content"]] == ["text"] and r["stop_reason"] == "end_turn"
    assert _as_text(CALL_LS) in r["content"][0]["text"]

    metrics = c.get("/metrics").text
    assert "splice_malformed_tool_calls_total 5.0" in metrics
