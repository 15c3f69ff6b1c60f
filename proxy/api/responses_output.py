"""The Response object a turn answers with: the request's context, output items (reasoning,
message, function / custom tool calls, compaction), the skeleton and its final fill. Shared by
``responses`` (the whole Response) and ``responses_stream`` (the items it streams)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tokenization.conversation import Message

from ..ids import call_id, custom_call_item_id, function_call_item_id, message_id, reasoning_id, response_id
from ..session import Presentation, TurnResult, returned_message
from . import responses_compact as compact
from .content import ToolSet, custom_input
from .context import DialectContext
from .jsonio import dumps
from .models import ResponsesRequest
from .output import splice_info, token_logprobs, usage_of
from .responses_conversation import messages_to_json


@dataclass
class ResponsesContext(DialectContext):
    """Everything about one request the output side needs."""

    req: ResponsesRequest
    history: list[Message]  # previous conversation + this input (without instructions)
    tools_echo: list[dict[str, Any]]
    created_at: float = field(default_factory=time.time)
    toolset: ToolSet = field(default_factory=ToolSet)
    compaction_trigger: bool = False  # the input ended with a compaction_trigger item (responses_compact)

    def present(self, result: TurnResult) -> Presentation:
        return present_response(self, result)


def reasoning_item(turn_id: str, text: str) -> dict[str, Any]:
    return {"id": reasoning_id(turn_id), "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def output_text_part(text: str, logprobs: list | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def message_item(turn_id: str, text: str, status: str, logprobs: list | None = None) -> dict[str, Any]:
    return {
        "id": message_id(turn_id),
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [output_text_part(text, logprobs)],
    }


def function_call_item(turn_id: str, k: int, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {
        "id": function_call_item_id(turn_id, k),
        "type": "function_call",
        "call_id": call_id(turn_id, k),
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def tool_call_item(ts: ToolSet, turn_id: str, k: int, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    """The output item of call ``k``: a ``function_call`` (with its ``namespace`` when the tool
    came from one) or, for a freeform tool, a ``custom_tool_call`` with its raw ``input``."""
    if name in ts.custom:
        return {
            "id": custom_call_item_id(turn_id, k),
            "type": "custom_tool_call",
            "call_id": call_id(turn_id, k),
            "name": name,
            "input": custom_input(arguments),
            "status": status,
        }
    item = function_call_item(turn_id, k, name, arguments, status)
    if name in ts.namespaces:
        item["namespace"], item["name"] = ts.namespaces[name]
    return item


def response_skeleton(ctx: ResponsesContext, turn_id: str) -> dict[str, Any]:
    req = ctx.req
    return {
        "id": response_id(turn_id),
        "object": "response",
        "created_at": int(ctx.created_at),
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls,
        "model": ctx.model,
        "output": [],
        "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
        "previous_response_id": req.previous_response_id,
        "reasoning": req.reasoning or {"effort": None, "summary": None},
        "service_tier": "default",
        "store": req.store is not False,
        "temperature": req.temperature if req.temperature is not None else 1.0,
        "text": req.text or {"format": {"type": "text"}},
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": ctx.tools_echo,
        "top_logprobs": req.top_logprobs or 0,
        "top_p": req.top_p if req.top_p is not None else 1.0,
        "truncation": req.truncation or "disabled",
        "usage": None,
        "user": req.user,
        "metadata": req.metadata or {},
    }


def wants_logprobs(req: ResponsesRequest) -> bool:
    return bool(req.include and "message.output_text.logprobs" in req.include)


def finish_response(body: dict[str, Any], ctx: ResponsesContext, result: TurnResult, output: list[dict[str, Any]]) -> dict[str, Any]:
    """Fill status, output, usage and the ``splice`` extension into a response skeleton."""
    length = result.finish_reason == "length"
    body = dict(body)
    body["status"] = "incomplete" if length else "completed"
    body["incomplete_details"] = {"reason": "max_output_tokens"} if length else None
    body["completed_at"] = int(time.time()) if not length else None
    body["model"] = result.model or ctx.model
    body["output"] = output
    u = usage_of(ctx.fmt, result, ctx.turn.chat_template_kwargs)
    body["usage"] = {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": u.output_tokens,
        "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
        "total_tokens": u.total_tokens,
    }
    body["splice"] = splice_info(result, ctx.turn)
    return body


def build_output(turn_id: str, result: TurnResult, logprobs: list | None = None, tools: ToolSet | None = None) -> list[dict[str, Any]]:
    p = result.parsed
    status = "incomplete" if result.finish_reason == "length" else "completed"
    out: list[dict[str, Any]] = []
    if p.reasoning:
        out.append(reasoning_item(turn_id, p.reasoning))
    if p.content or not p.tool_calls:
        out.append(message_item(turn_id, p.content, status, logprobs))
    for k, c in enumerate(p.tool_calls):
        out.append(tool_call_item(tools or ToolSet(), turn_id, k, c.name, c.arguments))
    return out


def present_response(ctx: ResponsesContext, result: TurnResult) -> Presentation:
    """The final Response object, and the conversation ``previous_response_id`` expands to."""
    if ctx.compaction_trigger:  # exactly one output item: the compaction (no conversation to chain onto)
        body = finish_response(response_skeleton(ctx, result.turn_id), ctx, result, [compact.compaction_item(result)])
        return Presentation(body=body, encoded=dumps(body))
    lp = token_logprobs(ctx.fmt, result) if wants_logprobs(ctx.req) else None
    body = finish_response(response_skeleton(ctx, result.turn_id), ctx, result, build_output(result.turn_id, result, lp, ctx.toolset))
    conversation = None if ctx.req.store is False else messages_to_json(ctx.history + [returned_message(result)])
    return Presentation(body=body, encoded=dumps(body), conversation=conversation)
