"""Parse sampled ids into reasoning, text and tool calls, through the renderer.

Splice's rules on top of the renderer's parser: every tool-call attempt is kept in order; a
malformed one is returned as text and flagged, never repaired; good calls beside it survive;
a call of a tool the request did not declare (any call when it declared none) is returned as
text and flagged the same way (status ``undeclared_tool``): no client could run it; output cut
by the length limit is reported as truncated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from renderers import ToolCallParseStatus


UNDECLARED = "undeclared_tool"  # MalformedCall.status of a call naming a tool the request did not offer


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, exactly as the model wrote the arguments value (compact re-dump)
    raw: str


@dataclass(frozen=True)
class MalformedCall:
    raw: str
    status: str  # renderers' ToolCallParseStatus value, e.g. "invalid_json", "unclosed_block"


@dataclass(frozen=True)
class ParsedOutput:
    content: str
    reasoning: str | None
    tool_calls: tuple[ParsedCall, ...] = ()
    malformed_calls: tuple[MalformedCall, ...] = ()
    reasoning_complete: bool = True
    truncated: bool = False  # generation stopped by the length limit

    @property
    def malformed(self) -> bool:
        return bool(self.malformed_calls)


def parse_output(
    renderer,
    output_ids: list[int],
    *,
    prompt_ids: list[int] | None = None,
    tools: list[dict] | None = None,
    finish_reason: str = "stop",
    stop_text: str | None = None,
    declared: frozenset[str] | None = None,
) -> ParsedOutput:
    """Parse one turn's sampled ids. Malformed calls are appended to ``content`` as their raw text.

    ``stop_text`` (a matched stop string) and whatever follows it are cut from the content.
    ``declared``: the tool names the request offered; a call of any other name is malformed
    (``undeclared_tool``). None: names are not checked.
    """
    parsed = renderer.parse_response(list(output_ids), tools=tools, prompt_ids=prompt_ids)
    calls: list[ParsedCall] = []
    bad: list[MalformedCall] = []
    content = parsed.content or ""
    if stop_text and stop_text in content:
        content = content[: content.index(stop_text)]
    for tc in parsed.tool_calls:
        if tc.status == ToolCallParseStatus.OK and tc.name and declared is not None and tc.name not in declared:
            bad.append(MalformedCall(raw=tc.raw, status=UNDECLARED))
        elif tc.status == ToolCallParseStatus.OK and tc.name:
            args = tc.arguments
            if isinstance(args, str):
                args_text = args
            else:
                args_text = json.dumps(args if args is not None else {}, ensure_ascii=False)
            calls.append(ParsedCall(name=tc.name, arguments=args_text, raw=tc.raw))
        else:
            status = tc.status.value if hasattr(tc.status, "value") else str(tc.status)
            bad.append(MalformedCall(raw=tc.raw, status=status))
    if bad:
        tail = "\n".join(f"<tool_call>{b.raw}" + ("" if b.status == "unclosed_block" else "</tool_call>") for b in bad)
        content = f"{content}\n{tail}" if content else tail
    return ParsedOutput(
        content=content,
        reasoning=parsed.reasoning_content or None,
        tool_calls=tuple(calls),
        malformed_calls=tuple(bad),
        reasoning_complete=bool(parsed.reasoning_complete) if parsed.reasoning_complete is not None else True,
        truncated=finish_reason == "length",
    )
