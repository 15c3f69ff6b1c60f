"""Drive a conversation the way the proxy does: render turn 1, splice every later turn."""

from __future__ import annotations

from tokenization import ChatFormat, Message, ToolCall


def assistant_from(cf: ChatFormat, prompt: list[int], output: list[int], *, call_prefix: str = "c") -> Message:
    """The assistant message an agent would send back for these sampled ids."""
    parsed = cf.parse(output, prompt_ids=prompt)
    calls = tuple(ToolCall(f"{call_prefix}{i}", c.name, c.arguments) for i, c in enumerate(parsed.tool_calls))
    return Message("assistant", parsed.content, reasoning=parsed.reasoning, tool_calls=calls)


def spliced_prompt(cf: ChatFormat, prompt, output, history, new, tools=None) -> list[int]:
    res = cf.bridge(prompt, output, new, tools=tools, history=history)
    assert res.ok, res.reason
    return list(prompt) + list(output) + res.ids
