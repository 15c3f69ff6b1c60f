"""splice serve --engine vllm against the reference engine's vLLM subset: splice, abort-resume
with echo, and proximal values after a version change the trainer announces itself."""

from __future__ import annotations

import threading

import httpx
import pytest
from openai import OpenAI

from .conftest import admin_headers, start_proxy

pytestmark = pytest.mark.slow

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>'
TOOLS = [{"type": "function", "function": {"name": "add", "description": "add", "parameters": {"type": "object", "properties": {}}}}]


def test_vllm_engine_path(tmp_path, model_dir):
    from engines.reference.testing import start_engine

    url, stop_engine = start_engine(model_dir, script=[CALL, "Three.<|im_end|>"], script_delay_s=0.03, served_model_name="served-tiny")
    proxy = start_proxy(tmp_path, model_dir, extra=["--engine", "vllm", "--engine-url", url, "--tokenizer", model_dir,
                                                   "--renderer", "qwen3", "--model-name", "agent-facing-name"])
    try:
        client = OpenAI(base_url=proxy.url + "/v1", api_key="x", default_headers={"X-Session-Id": "v"})

        def update():
            assert proxy.post("/admin/pause").status_code == 200
            assert proxy.post("/admin/version", {"version": 1}).json()["version"] == 1
            assert proxy.post("/admin/resume").status_code == 200

        admin = threading.Thread(target=update)
        msgs = [{"role": "user", "content": "add 1 2"}]
        call = {"id": None, "name": "", "arguments": ""}
        # The stream starts at the first sampled token: update the weights while the rest is generated.
        for chunk in client.chat.completions.create(model="agent-facing-name", messages=msgs, tools=TOOLS, stream=True):
            if not admin.is_alive() and admin.ident is None:
                admin.start()
            for choice in chunk.choices:
                for tc in choice.delta.tool_calls or []:
                    call["id"] = tc.id or call["id"]
                    call["name"] += (tc.function.name or "") if tc.function else ""
                    call["arguments"] += (tc.function.arguments or "") if tc.function else ""
        admin.join()
        assert call["name"] == "add"
        assistant = {"role": "assistant", "content": None, "tool_calls": [
            {"id": call["id"], "type": "function", "function": {"name": "add", "arguments": call["arguments"]}}]}
        msgs += [assistant, {"role": "tool", "tool_call_id": call["id"], "content": "3"}]
        r2 = client.chat.completions.create(model="agent-facing-name", messages=msgs, tools=TOOLS)
        assert r2.choices[0].message.content == "Three."
        t1, t2 = httpx.get(proxy.url + "/v1/sessions/v", headers=admin_headers(), timeout=30).json()["turns"]
        assert t2["spliced"]
        assert t1["versions"][0] == 0 and t1["versions"][-1] == 1  # the update landed mid-generation
        for v, pv in zip(t1["versions"], t1["proximal_versions"]):
            assert pv == 1  # v0 tokens got their v1 value through the echo prefill; v1 tokens are their own
    finally:
        proxy.stop()
        stop_engine()
