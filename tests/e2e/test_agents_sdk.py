"""The openai-agents SDK against splice serve + the reference engine in script mode."""

from __future__ import annotations

import asyncio
import uuid

import pytest

pytestmark = pytest.mark.slow


def call(a: int, b: int, think: str) -> str:
    return f'<think>\n{think}\n</think>\n\n<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call><|im_end|>'


SCRIPT = [
    call(1, 2, "first add"),
    call(3, 4, "second add"),
    call(5, 6, "third add"),
    "<think>\nall done\n</think>\n\nThe sums are 3, 7 and 11.<|im_end|>",
]


def _agent(base_url: str, session_id: str):
    from agents import Agent, OpenAIResponsesModel, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", default_headers={"X-Session-Id": session_id})

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    return Agent(name="adder", instructions="Use the add tool.", tools=[add], model=OpenAIResponsesModel(model="splice-model", openai_client=client))


def _check_session(proxy, session_id: str, turns_expected: int) -> dict:
    s = proxy.get(f"/v1/sessions/{session_id}").json()
    turns = s["turns"]
    assert len(turns) == turns_expected
    for prev, cur in zip(turns, turns[1:]):
        assert cur["spliced"], cur["fork_reason"]
        full_prev = prev["prompt_ids"] + prev["output_ids"]
        assert cur["prompt_ids"][: len(full_prev)] == full_prev
    for t in turns:
        n = len(t["output_ids"])
        assert len(t["output_logprobs"]) == len(t["versions"]) == len(t["proximal_logprobs_t"]) == len(t["proximal_versions"]) == n
    return s


def test_runner_run_three_tool_turns_spliced(proxy_factory):
    from agents import Runner

    proxy = proxy_factory(script=SCRIPT)
    sid = "sess-" + uuid.uuid4().hex[:8]
    result = asyncio.run(Runner.run(_agent(proxy.url, sid), "Add 1+2, 3+4 and 5+6."))
    assert "3, 7 and 11" in result.final_output
    _check_session(proxy, sid, 4)


def test_runner_run_streamed(proxy_factory):
    from agents import Runner

    proxy = proxy_factory(script=SCRIPT, delay_ms=2)
    sid = "sess-" + uuid.uuid4().hex[:8]

    async def go():
        run = Runner.run_streamed(_agent(proxy.url, sid), "Add 1+2, 3+4 and 5+6.")
        kinds = []
        async for ev in run.stream_events():
            kinds.append(ev.type)
        return run.final_output, kinds

    final, kinds = asyncio.run(go())
    assert "3, 7 and 11" in final
    assert "raw_response_event" in kinds
    _check_session(proxy, sid, 4)
