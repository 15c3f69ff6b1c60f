"""``--history-edits keep`` (or ``X-Splice-History-Edits: keep``): a replayed history that differs
from the recorded turns only in system / developer text or earlier tool-call arguments continues
the recorded tokens (the engine is sent exactly what was recorded, plus the new messages); the
edit is recorded with the turn, counted in ``/metrics`` and reported in the ``splice`` block.
Any other difference still forks, and ``fork`` (the default) forks on all of them.

Real parts: the reference engine (script mode) over HTTP, the proxy app and store, the real
Qwen3 tokenizer and chat template."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

CALL = '<tool_call>\n{"name": "shell", "arguments": {"cmd": "ls"}}\n</tool_call><|im_end|>'
SHELL = {"type": "function", "function": {"name": "shell", "description": "Run.", "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from engines.reference.model_init import init_model
    from engines.reference.testing import start_engine_in_thread

    model = init_model(tmp_path_factory.mktemp("edits") / "model", max_position_embeddings=4096)
    url, stop = start_engine_in_thread(model, script=[CALL] + ["Done.<|im_end|>"] * 40)
    yield model, url
    stop()


def _client(engine, tmp_path, **settings):
    from engines.pool import EnginePool
    from proxy.app import create_app
    from proxy.settings import Settings
    from tokenization import ChatFormat, load_tokenizer

    model, url = engine
    app = create_app(Settings(store=str(tmp_path / "s.sqlite"), **settings), fmt=ChatFormat(load_tokenizer(str(model)), "qwen3"),
                     pool=EnginePool("sglang", [url], health_interval_s=0))  # fmt: skip
    return TestClient(app)


@pytest.fixture
def app_client(engine, tmp_path):
    with _client(engine, tmp_path) as c:
        yield c


def _history(system: str, cmd: str, call: dict) -> list[dict]:
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": "list the files"},
        {"role": "assistant", "content": None, "tool_calls": [{**call, "function": {"name": "shell", "arguments": json.dumps({"cmd": cmd})}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": "a.txt"},
    ]


def test_keep_continues_the_recorded_tokens_and_records_the_edit(app_client):
    c = app_client
    first = [{"role": "system", "content": "You are an agent. Model: tiny-1"}, {"role": "user", "content": "list the files"}]
    # the policy is the harness's for the whole run (a header on every request, or the server's)
    r1 = c.post("/v1/chat/completions", json={"messages": first, "tools": [SHELL]}, headers={"X-Session-Id": "cc", "X-Splice-History-Edits": "keep"}).json()
    call = r1["choices"][0]["message"]["tool_calls"][0]
    t1 = c.get("/v1/sessions/cc").json()["turns"][0]

    def post(messages, policy=None, session="cc"):
        h = {"X-Session-Id": session} | ({"X-Splice-History-Edits": policy} if policy else {})
        return c.post("/v1/chat/completions", json={"messages": messages, "tools": [SHELL]}, headers=h)

    # the harness changed its own system prompt and rewrote the earlier call's arguments
    edited = _history("You are an agent. Model: tiny-2", "ls -la", call)
    r = post(edited, "keep").json()
    assert r["splice"]["spliced"] and r["splice"]["fork_reason"] is None
    assert r["splice"]["history_edits"] == ["system_text", "tool_arguments"]
    turns = c.get("/v1/sessions/cc").json()["turns"]
    t2 = turns[-1]
    recorded = t1["prompt_ids"] + t1["output_ids"]
    assert t2["parent_turn_id"] == t1["turn_id"] and t2["prompt_ids"][: len(recorded)] == recorded  # what was recorded
    assert t2["requested_sampling"]["history_edits"] == ["system_text", "tool_arguments"]
    metrics = c.get("/metrics").text
    assert 'splice_history_edits_kept_total{edit="system_text"} 1.0' in metrics
    assert 'splice_history_edits_kept_total{edit="tool_arguments"} 1.0' in metrics

    # only the system text edited: named as such
    r = post(_history("You are an agent. Model: tiny-3", "ls", call), "keep").json()
    assert r["splice"]["spliced"] and r["splice"]["history_edits"] == ["system_text"]

    # fork (the server's default here): the same edit is a new sample
    r = post(edited).json()
    assert not r["splice"]["spliced"] and r["splice"]["fork_reason"] == "history_edited" and r["splice"]["history_edits"] == []

    # keep does not cover other edits: a rewritten user message still forks
    other = _history("You are an agent. Model: tiny-1", "ls", call)
    other[1]["content"] = "list the hidden files"
    r = post(other, "keep").json()
    assert not r["splice"]["spliced"] and r["splice"]["fork_reason"] == "history_edited"

    # the unedited continuation is a plain splice, with no edit reported
    r = post(_history("You are an agent. Model: tiny-1", "ls", call), "keep").json()
    assert r["splice"]["spliced"] and r["splice"]["history_edits"] == []

    assert c.post("/v1/chat/completions", json={"messages": first}, headers={"X-Splice-History-Edits": "maybe"}).status_code == 400


def test_keep_as_the_server_default(engine, tmp_path):
    """``splice serve --history-edits keep`` applies to requests that do not say; a request's
    header still picks ``fork``."""
    with _client(engine, tmp_path, history_edits="keep") as c:
        first = [{"role": "system", "content": "Model: a"}, {"role": "user", "content": "hi"}]
        r = c.post("/v1/chat/completions", json={"messages": first}, headers={"X-Session-Id": "d"}).json()
        later = [{"role": "system", "content": "Model: b"}, first[1], {"role": "assistant", "content": r["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "again"}]  # fmt: skip
        r = c.post("/v1/chat/completions", json={"messages": later}, headers={"X-Session-Id": "d"}).json()
        assert r["splice"]["spliced"] and r["splice"]["history_edits"] == ["system_text"]
        r = c.post("/v1/chat/completions", json={"messages": later}, headers={"X-Session-Id": "d", "X-Splice-History-Edits": "fork"}).json()
        assert r["splice"]["fork_reason"] == "history_edited"


def test_planner_keep_policy():
    """The pure planner with the policy on the request (in-memory lookup, real chat format)."""
    from proxy.session.planner import plan
    from proxy.session.turn import TurnRequest
    from tests.proxy.session.test_planner import MemoryLookup
    from tokenization import ChatFormat, Message, ToolCall, load_tokenizer, qwen3_tokenizer_dir

    fmt = ChatFormat(load_tokenizer(str(qwen3_tokenizer_dir())), "qwen3")
    lookup = MemoryLookup()
    first = [Message("system", "v1"), Message("user", "go")]
    req = TurnRequest(api="chat", messages=first, turn_id="t0", session_id="s", history_edits_policy="keep")
    p0 = plan(req, lookup, fmt)
    answer = Message("assistant", "", tool_calls=(ToolCall("c1", "shell", '{"cmd": "ls"}'),))
    out = fmt.tokenizer.encode(CALL, add_special_tokens=False)
    lookup.record(req, p0, "t0", answer, out)
    edited = [Message("system", "v2"), Message("user", "go"), Message("assistant", "", tool_calls=(ToolCall("c1", "shell", '{"cmd": "pwd"}'),)),
              Message("tool", "x", tool_call_id="c1")]  # fmt: skip
    p1 = plan(TurnRequest(api="chat", messages=edited, turn_id="t1", session_id="s", history_edits_policy="keep"), lookup, fmt)
    assert p1.spliced and p1.history_edits == ("system_text", "tool_arguments")
    assert p1.prompt_ids[: len(p0.prompt_ids) + len(out)].tolist() == p0.prompt_ids.tolist() + out
    p2 = plan(TurnRequest(api="chat", messages=edited, turn_id="t2", session_id="s", history_edits_policy="fork"), lookup, fmt)
    assert not p2.spliced and p2.fork_reason == "history_edited"
