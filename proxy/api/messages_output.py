"""The Anthropic ``message`` a turn answers with: its context, content blocks (thinking, text,
tool_use), stop reason and usage. Shared by ``messages`` (the whole reply) and
``messages_stream`` (the skeleton it streams into)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from ..ids import message_id, tool_use_id
from ..session import Presentation, TurnResult
from .content import ToolSet
from .context import DialectContext
from .jsonio import dumps
from .models import MessagesRequest
from .output import splice_info, usage_of


@dataclass
class MessagesContext(DialectContext):
    req: MessagesRequest
    toolset: ToolSet
    created_at: float = field(default_factory=time.time)

    def present(self, result: TurnResult) -> Presentation:
        body = message_body(self, result)
        return Presentation(body=body, encoded=dumps(body))


def stop_reason_of(result: TurnResult) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)``."""
    gen = result.generation
    if result.finish_reason == "length":
        return "max_tokens", None
    if result.parsed.tool_calls:
        return "tool_use", None
    if isinstance(gen.matched_stop, str):
        return "stop_sequence", gen.matched_stop
    return "end_turn", None


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the ``input`` object Anthropic clients expect."""
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def content_blocks(turn_id: str, result: TurnResult) -> list[dict[str, Any]]:
    p = result.parsed
    out: list[dict[str, Any]] = []
    if p.reasoning:
        out.append({"type": "thinking", "thinking": p.reasoning, "signature": turn_id})
    if p.content or not p.tool_calls:
        out.append({"type": "text", "text": p.content})
    for k, c in enumerate(p.tool_calls):
        out.append({"type": "tool_use", "id": tool_use_id(turn_id, k), "name": c.name, "input": tool_input(c.arguments)})
    return out


def message_usage(ctx: MessagesContext, result: TurnResult) -> dict[str, Any]:
    """Anthropic counts cache reads apart from ``input_tokens``."""
    u = usage_of(ctx.fmt, result, ctx.turn.chat_template_kwargs)
    cached = min(u.cached_tokens, u.prompt_tokens)
    return {
        "input_tokens": u.prompt_tokens - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": u.output_tokens,
    }


def message_skeleton(ctx: MessagesContext) -> dict[str, Any]:
    return {
        "id": message_id(ctx.turn_id),
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": ctx.model,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 0, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0, "output_tokens": 0},
    }


def message_body(ctx: MessagesContext, result: TurnResult) -> dict[str, Any]:
    stop_reason, stop_sequence = stop_reason_of(result)
    body = message_skeleton(ctx)
    body.update(
        content=content_blocks(result.turn_id, result),
        model=result.model or ctx.model,
        stop_reason=stop_reason,
        stop_sequence=stop_sequence,
        usage=message_usage(ctx, result),
        splice=splice_info(result, ctx.turn),
    )
    return body
