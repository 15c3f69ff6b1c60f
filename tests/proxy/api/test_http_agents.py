"""Requests shaped like Codex's (namespace, hosted and freeform tools; its session header) and
the controls Splice records but does not enforce, on the Responses and Chat APIs."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from proxy.api.content import offer_tools
from proxy.ids import turn_id_from
from tests.proxy.api.agents_server import serve

EXEC = {
    "type": "function",
    "name": "exec_command",
    "description": "Runs a command.",
    "strict": False,
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
}
NAMESPACE = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Tools for sub-agents.",
    "tools": [
        {"type": "function", "name": "wait_agent", "description": "Wait.", "strict": False, "parameters": {"type": "object", "properties": {}}},
        {"type": "function", "name": "exec_command", "description": "Clashes.", "strict": False, "parameters": {"type": "object", "properties": {}}},
    ],
}
APPLY_PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Apply a patch.",
    "format": {"type": "grammar", "syntax": "lark", "definition": "start: begin_patch"},
}
CODEX_TOOLS = [EXEC, NAMESPACE, APPLY_PATCH, {"type": "web_search", "external_web_access": False}, {"type": "image_generation"}]


def call(name: str, args: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call><|im_end|>"


@pytest.fixture(scope="module")
def aserver(tok, renderer):
    with serve(tok, renderer) as h:
        yield h


@pytest.fixture
def live(aserver):
    aserver.runner.reset()
    return aserver


def _post(live, body, **headers):
    r = httpx.post(live.base_url + "/v1/responses", json=body, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_tool_flattening():
    ts = offer_tools(CODEX_TOOLS)
    assert [t.name for t in ts.tools] == ["exec_command", "wait_agent", "multi_agent_v1__exec_command", "apply_patch"]
    assert ts.namespaces == {"wait_agent": ("multi_agent_v1", "wait_agent"), "multi_agent_v1__exec_command": ("multi_agent_v1", "exec_command")}
    assert ts.custom == frozenset({"apply_patch"}) and ts.not_offered == ["web_search", "image_generation"]
    patch = ts.tools[-1].parameters
    assert patch["required"] == ["input"] and "start: begin_patch" in patch["properties"]["input"]["description"]
    assert ts.visible_name("multi_agent_v1", "exec_command") == "multi_agent_v1__exec_command"
    assert ts.visible_name(None, "exec_command") == "exec_command"


def test_namespaced_call_comes_back_with_its_namespace(live):
    live.runner.script(call("wait_agent", {"targets": ["a"]}), "done<|im_end|>")
    body = {"model": "m", "input": "wait", "tools": CODEX_TOOLS, "store": False}
    r1 = _post(live, body, **{"session-id": "codex-thread-1"})
    fc = r1["output"][-1]
    tid = turn_id_from(r1["id"])
    assert fc["type"] == "function_call" and fc["name"] == "wait_agent" and fc["namespace"] == "multi_agent_v1"
    assert fc["call_id"] == f"call_{tid}_0"
    assert r1["splice"]["tools_not_offered"] == ["image_generation", "web_search"]
    req = live.runner.requests[-1]
    assert req.session_id == "codex-thread-1"  # Codex's own thread id names the session
    assert req.tools_not_offered == ["web_search", "image_generation"]
    # Codex replays the call with its namespace; the model sees the name it called
    body2 = dict(body, input=[{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "wait"}]}, fc,
                              {"type": "function_call_output", "call_id": fc["call_id"], "output": "ok"}])  # fmt: skip
    _post(live, body2, **{"session-id": "codex-thread-1"})
    asst = live.runner.requests[-1].messages[1]
    assert asst.tool_calls[0].name == "wait_agent" and live.runner.requests[-1].parent_hint == tid


def test_custom_tool_call_roundtrip(live):
    patch = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch"
    live.runner.script(call("apply_patch", {"input": patch}), "applied<|im_end|>")
    body = {"model": "m", "input": "patch it", "tools": CODEX_TOOLS}
    r1 = _post(live, body)
    item = r1["output"][-1]
    tid = turn_id_from(r1["id"])
    assert item == {"id": f"ctc_{tid}_0", "type": "custom_tool_call", "call_id": f"call_{tid}_0", "name": "apply_patch", "input": patch, "status": "completed"}
    body2 = dict(body, input=[{"type": "message", "role": "user", "content": "patch it"}, item,
                              {"type": "custom_tool_call_output", "call_id": item["call_id"], "output": "Done!"}])  # fmt: skip
    _post(live, body2)
    req = live.runner.requests[-1]
    asst, tool = req.messages[1], req.messages[2]
    assert asst.tool_calls[0].name == "apply_patch" and json.loads(asst.tool_calls[0].arguments) == {"input": patch}
    assert tool.role == "tool" and tool.content == "Done!" and req.parent_hint == tid


def test_streamed_custom_and_namespaced_calls(live):
    patch = "*** Begin Patch\n*** End Patch"
    two = (
        f"<tool_call>\n{json.dumps({'name': 'apply_patch', 'arguments': {'input': patch}})}\n</tool_call>\n"
        f"<tool_call>\n{json.dumps({'name': 'wait_agent', 'arguments': {}})}\n</tool_call><|im_end|>"
    )
    live.runner.script(two)
    client = openai.OpenAI(base_url=live.base_url + "/v1", api_key="x", max_retries=0)
    events = list(client.responses.create(model="m", input="go", tools=CODEX_TOOLS, stream=True))
    kinds = [e.type for e in events]
    assert "response.custom_tool_call_input.delta" in kinds and "response.custom_tool_call_input.done" in kinds
    done = [e.item for e in events if e.type == "response.output_item.done"]
    custom = next(i for i in done if i.type == "custom_tool_call")
    assert custom.input == patch and custom.name == "apply_patch"
    ns = next(i for i in done if i.type == "function_call")
    assert ns.name == "wait_agent" and ns.namespace == "multi_agent_v1"  # a field of the SDK's own model
    final = events[-1].response
    assert [o.type for o in final.output] == ["custom_tool_call", "function_call"]


def test_controls_are_recorded_not_enforced(live):
    live.runner.script("plain text<|im_end|>")
    body = {
        "model": "m", "input": "x", "tools": [EXEC], "tool_choice": "required", "parallel_tool_calls": False,
        "max_tool_calls": 2, "text": {"format": {"type": "json_schema", "name": "o", "schema": {"type": "object"}}},
    }  # fmt: skip
    r = _post(live, body)
    assert r["splice"]["controls_not_enforced"] == ["max_tool_calls", "parallel_tool_calls", "text.format", "tool_choice"]
    assert r["tool_choice"] == "required" and r["parallel_tool_calls"] is False  # echoed as sent
    req = live.runner.requests[-1]
    assert req.controls_not_enforced["tool_choice"] == "required" and req.controls_not_enforced["max_tool_calls"] == 2
    # tool_choice "none" keeps the tools offered (removing them would change the render: a fork)
    _post(live, dict(body, tool_choice="none", parallel_tool_calls=True, max_tool_calls=None, text=None))
    req = live.runner.requests[-1]
    assert [t.name for t in req.tools] == ["exec_command"] and req.controls_not_enforced == {"tool_choice": "none"}
    # defaults report nothing
    r = _post(live, {"model": "m", "input": "x", "tools": [EXEC], "tool_choice": "auto", "parallel_tool_calls": True})
    assert r["splice"]["controls_not_enforced"] == [] and r["splice"]["tools_not_offered"] == []


def test_chat_controls_and_hosted_tools(live):
    live.runner.script("{}<|im_end|>")
    body = {
        "model": "m", "messages": [{"role": "user", "content": "x"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}, {"type": "web_search"}],
        "tool_choice": {"type": "function", "function": {"name": "f"}}, "response_format": {"type": "json_object"},
    }  # fmt: skip
    r = httpx.post(live.base_url + "/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["splice"]["controls_not_enforced"] == ["response_format", "tool_choice"]
    assert r.json()["splice"]["tools_not_offered"] == ["web_search"]


def test_unknown_tool_types_are_still_400(live):
    r = httpx.post(live.base_url + "/v1/responses", json={"model": "m", "input": "x", "tools": [{"type": "teleporter"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0]"
