"""A first turn equal to a recent one reuses its prompt ids (``proxy/session/first_renders.py``).

The reference is the model's own ``apply_chat_template``: every first turn's prompt, reused or
rendered, must be what the template makes of that request, so a reuse for a request that differs
anywhere (a message past its first 64 characters, a tool's schema, a template kwarg, a tool
message's name) would show as a wrong prompt."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
import respx

from engines.pool import EnginePool
from proxy.app import create_app
from proxy.session.first_renders import ENTRY_CHARS, FirstRenders
from proxy.settings import Settings
from tests.fakes.engines import FakeSGLang, Step
from tokenization import ChatFormat, Message, load_tokenizer, qwen3_tokenizer_dir
from tokenization.conversation import Tool

TOK = load_tokenizer(str(qwen3_tokenizer_dir()))
URL = "http://engine-a:30000"
TASK = "Fix the failing test in the repository. " + "The details follow. " * 10
SYSTEM = {"role": "system", "content": "You are a careful coding agent."}
TOOLS = [{"type": "function", "function": {"name": "run", "description": "Run a command.",
                                           "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}]  # fmt: skip


def _reference(messages, tools, **kwargs) -> list[int]:
    out = TOK.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _first_turns(tmp_path, requests):
    """POST each (body, headers) as a first turn; (the ids the engine got, render metric, reused metric)."""

    async def main():
        with respx.mock(assert_all_called=False) as router:
            engine = FakeSGLang(router, URL)
            engine.script = [Step(tokens=[(t, -0.5) for t in TOK.encode("Done.<|im_end|>", add_special_tokens=False)])
                             for _ in requests]  # fmt: skip
            app = create_app(Settings(store=str(tmp_path / "s.sqlite"), engine_url=[URL]), fmt=ChatFormat(TOK, "qwen3"),
                             pool=EnginePool("sglang", [URL], health_interval_s=0))  # fmt: skip
            async with app.router.lifespan_context(app):
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as c:
                    for body, headers in requests:
                        r = await c.post("/v1/chat/completions", json=body, headers=headers)
                        assert r.status_code == 200, r.text
                count = app.state.runner.fmt.render_calls
                reused = app.state.metrics.render_reused._value.get()
            return [req["input_ids"] for req in engine.requests], count, reused

    return asyncio.run(main())


def test_a_group_opening_alike_renders_once_and_every_prompt_is_the_templates(tmp_path):
    msgs = [SYSTEM, {"role": "user", "content": TASK}]
    group = [({"messages": msgs, "tools": TOOLS}, {"X-Session-Id": f"g-{k}"}) for k in range(4)]
    sent, renders, reused = _first_turns(tmp_path, group)
    assert all(ids == _reference(msgs, TOOLS) for ids in sent)
    assert renders == 1 and reused == 3


@pytest.mark.parametrize("change", ["late_text", "tool_schema", "kwargs", "tool_name", "extra_message"])
def test_a_first_turn_that_differs_anywhere_is_rendered(tmp_path, change):
    msgs = [SYSTEM, {"role": "user", "content": TASK}]
    body = {"messages": msgs, "tools": TOOLS}
    other_msgs, other_tools, kwargs = [dict(m) for m in msgs], [dict(t) for t in TOOLS], {}
    if change == "late_text":  # same length, same first 64 characters: only a full compare tells
        other_msgs[1]["content"] = TASK[:-2] + "!" + TASK[-1]
    elif change == "tool_schema":
        other_tools = [{"type": "function", "function": {**TOOLS[0]["function"], "parameters": {"type": "object", "properties": {}}}}]
    elif change == "kwargs":
        kwargs = {"enable_thinking": False}
    elif change == "tool_name":  # a tool message's name is a field the template may render
        other_msgs = [SYSTEM, {"role": "user", "content": TASK}, {"role": "tool", "tool_call_id": "x", "content": "ok", "name": "a"}]
        msgs = [SYSTEM, {"role": "user", "content": TASK}, {"role": "tool", "tool_call_id": "x", "content": "ok", "name": "b"}]
        body = {"messages": msgs, "tools": TOOLS}
    elif change == "extra_message":
        other_msgs = [*msgs, {"role": "user", "content": "And be quick."}]
    other = {"messages": other_msgs, "tools": other_tools, **({"chat_template_kwargs": kwargs} if kwargs else {})}
    sent, renders, reused = _first_turns(tmp_path, [(body, {"X-Session-Id": "a"}), (other, {"X-Session-Id": "b"})])
    assert sent[0] == _reference(body["messages"], body["tools"])
    assert sent[1] == _reference(other_msgs, other_tools, **kwargs)
    assert sent[0] != sent[1] or change == "tool_name"
    assert renders == 2 and reused == 0


def test_kept_ids_are_read_only_and_bounded():
    kept = FirstRenders(max_chars=2 * (6 + ENTRY_CHARS))  # room for two entries
    conv = lambda k: [Message(role="user", content=f"task {k}")]  # noqa: E731
    arr = kept.put(conv(0), [], None, 6, [1, 2, 3])
    assert arr.dtype == np.int32 and not arr.flags.writeable
    with pytest.raises(ValueError):
        arr[0] = 9
    kept.put(conv(1), [], None, 6, [4])
    kept.put(conv(2), [], None, 6, [5])  # the oldest goes
    assert kept.get(conv(0), [], None, 6) is None
    assert kept.get(conv(2), [], None, 6).tolist() == [5] and kept.reused == 1
    tool = Tool("run", "Run.", {"type": "object"})
    kept.put(conv(3), [tool], {"k": 1}, 6, [7])
    assert kept.get(conv(3), [tool], {"k": 2}, 6) is None
    assert kept.get(conv(3), [Tool("run", "Run!", {"type": "object"})], {"k": 1}, 6) is None
    assert kept.get(conv(3), [tool], {"k": 1}, 6).tolist() == [7]
