"""OpenAI Responses API: ``POST /v1/responses``, ``GET /v1/responses/{id}``.

Input items become Splice ``Message``s the way the chat template sees one conversation:
a reasoning item, an assistant message and the function calls that follow them are ONE
assistant turn; ``function_call_output`` items are tool messages; ``instructions`` is a
system message in front. ``previous_response_id`` prepends the stored conversation of that
response (its input and its output, not its instructions, as OpenAI does).

Output follows OpenAI's Response object (built from the turn's parse of the sampled ids,
and stored with the turn in one transaction); streaming is ``responses_stream``. Remote
compaction (``POST /v1/responses/compact``, a ``compaction_trigger`` input item, ``compaction``
items sent back) is ``responses_compact``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import APIRouter, Request

from tokenization.conversation import Message, ToolCall
from tokenization.vision import ImageInfo

from ..errors import APIError, bad_request, not_found
from ..ids import call_id, custom_call_item_id, function_call_item_id, message_id, reasoning_id, response_id, turn_id_from
from ..session import Presentation, TurnResult, TurnRunner, returned_message
from .content import (
    ToolSet, check_tool_choice, custom_arguments, custom_input, message_of, name_tool_messages, offer_tools, text_of,
    tool_choice_control,
)  # fmt: skip
from .context import DialectContext, check_id, turn_request
from .images import ImageInput, ImageRequest
from .jsonio import JSONResponse, body_schema, build, dumps, parse_json_body, validate
from .models import ResponsesRequest
from .output import splice_headers, splice_info, token_logprobs, usage_of
from .streaming import TurnStream, run_turn, streaming_response
from . import responses_compact as compact

# ============================================================================ stored conversations


def message_to_dict(m: Message) -> dict[str, Any]:
    d: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.reasoning is not None:
        d["reasoning"] = m.reasoning
    if m.tool_calls:
        d["tool_calls"] = [{"id": tc.id, "name": tc.name, "arguments": tc.arguments} for tc in m.tool_calls]
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        d["name"] = m.name
    if m.has_images:  # images by reference: their bytes are stored once, by hash, with the turn
        d["parts"] = [
            {"text": p} if isinstance(p, str) else
            {"image": {"hash": p.hash, "mime": p.mime, "width": p.width, "height": p.height, "grid_thw": list(p.grid_thw), "n_tokens": p.n_tokens}}
            for p in m.parts
        ]  # fmt: skip
    return d


def _part_from_dict(p: dict[str, Any]) -> Any:
    if "image" not in p:
        return p.get("text", "")
    i = p["image"]
    # ``data`` is not kept with the conversation: the image store has it under ``hash``.
    return ImageInfo(hash=i["hash"], mime=i["mime"], width=i["width"], height=i["height"], grid_thw=tuple(i["grid_thw"]), n_tokens=i["n_tokens"], data=b"")


def message_from_dict(d: dict[str, Any]) -> Message:
    return Message(
        role=d["role"],
        content=d.get("content") or "",
        reasoning=d.get("reasoning"),
        tool_calls=tuple(ToolCall(tc["id"], tc["name"], tc["arguments"]) for tc in d.get("tool_calls") or ()),
        tool_call_id=d.get("tool_call_id"),
        name=d.get("name"),
        parts=tuple(_part_from_dict(p) for p in d.get("parts") or ()),
    )


def messages_to_json(messages: list[Message]) -> bytes:
    """The stored form of a conversation: a JSON list of messages (prefix-friendly)."""
    return orjson.dumps([message_to_dict(m) for m in messages])


def messages_from_json(data: bytes | str) -> list[Message]:
    raw = orjson.loads(data)
    if isinstance(raw, dict):  # tolerate {"messages": [...]}
        raw = raw.get("messages", [])
    return [message_from_dict(d) for d in raw]


# ============================================================================ input conversion

_ROLES = {"user", "system", "developer", "assistant"}


@dataclass
class _PendingAssistant:
    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    has_reasoning_item: bool = False

    def message(self) -> Message:
        return Message(
            role="assistant",
            content=self.content or "",
            reasoning=self.reasoning or None,
            tool_calls=tuple(self.tool_calls),
        )


def _reasoning_text(item: dict[str, Any], where: str) -> str | None:
    content = item.get("content")
    if content:
        return text_of(content, f"{where}.content") or None
    summary = item.get("summary")
    if summary:
        if not isinstance(summary, list):
            raise bad_request(f"{where}.summary must be a list", code="invalid_value", param=f"{where}.summary")
        parts = [s.get("text", "") if isinstance(s, dict) else str(s) for s in summary]
        return "\n\n".join(p for p in parts if p) or None
    return None  # encrypted_content only: nothing Splice can render


def input_to_messages(
    items: str | list[dict[str, Any]] | None, tools: ToolSet | None = None, images: ImageRequest | None = None
) -> tuple[list[Message], list[str]]:
    """Convert Responses input to messages; also return the ids the input carries, in order.

    Consecutive reasoning / assistant message / function_call items merge into one assistant
    message (the template renders them as one turn). ``input_image`` parts of user messages and
    of ``function_call_output`` / ``computer_call_output`` outputs become image parts through
    ``images`` (a text-only model's requests get a 400).
    """
    images = images if images is not None else ImageRequest(None)
    if items is None:
        return [], []
    if isinstance(items, str):
        return [Message(role="user", content=items)], []
    out: list[Message] = []
    ids: list[str] = []
    pending: _PendingAssistant | None = None

    def flush() -> None:
        nonlocal pending
        if pending is not None:
            out.append(pending.message())
            pending = None

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", code="invalid_value", param=where)
        typ = item.get("type")
        if typ is None and "role" in item:
            typ = "message"
        for key in ("id", "call_id"):
            v = item.get(key)
            if isinstance(v, str) and v:
                ids.append(v)
        if typ == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise bad_request(f"{where}.role must be one of user, assistant, system, developer; got {role!r}", code="invalid_value", param=f"{where}.role")
            if "content" not in item:
                raise bad_request(f"{where} is a message without 'content'", code="missing_required_parameter", param=f"{where}.content")
            if role == "assistant":
                text = text_of(item.get("content"), f"{where}.content")
                if pending is not None and (pending.content is not None or pending.tool_calls):
                    flush()
                if pending is None:
                    pending = _PendingAssistant()
                pending.content = text
            else:
                flush()
                imgs = images if role == "user" else None
                out.append(message_of(role, item.get("content"), f"{where}.content", images=imgs))
        elif typ == "reasoning":
            text = _reasoning_text(item, where)
            if pending is not None and (pending.has_reasoning_item or pending.content is not None or pending.tool_calls):
                flush()
            if pending is None:
                pending = _PendingAssistant()
            pending.has_reasoning_item = True
            pending.reasoning = text
        elif typ in ("function_call", "custom_tool_call"):
            name = item.get("name")
            cid = item.get("call_id") or item.get("id")
            args = item.get("arguments", "")
            if not isinstance(name, str) or not name:
                raise bad_request(f"{where} (function_call) needs a 'name'", code="missing_required_parameter", param=f"{where}.name")
            if not isinstance(cid, str) or not cid:
                raise bad_request(f"{where} (function_call) needs a 'call_id'", code="missing_required_parameter", param=f"{where}.call_id")
            if typ == "custom_tool_call":
                args = custom_arguments(str(item.get("input", "")))
            elif not isinstance(args, str):
                args = orjson.dumps(args).decode()
            if tools is not None:
                name = tools.visible_name(item.get("namespace"), name)
            if pending is None:
                pending = _PendingAssistant()
            pending.tool_calls.append(ToolCall(id=cid, name=name, arguments=args))
        elif typ in ("function_call_output", "custom_tool_call_output"):
            flush()
            cid = item.get("call_id")
            if not isinstance(cid, str) or not cid:
                raise bad_request(f"{where} (function_call_output) needs a 'call_id'", code="missing_required_parameter", param=f"{where}.call_id")
            if "output" not in item:
                raise bad_request(f"{where} (function_call_output) needs an 'output'", code="missing_required_parameter", param=f"{where}.output")
            output = item.get("output")
            if isinstance(output, dict) and output.get("type") in ("input_image", "input_text"):
                output = [output]  # one content part
            elif isinstance(output, (dict, int, float, bool)) and not isinstance(output, list):
                output = orjson.dumps(output).decode()
            out.append(message_of("tool", output, f"{where}.output", images=images, tool_call_id=cid))
        elif typ == "computer_call_output":
            flush()
            cid = item.get("call_id")
            if not isinstance(cid, str) or not cid:
                raise bad_request(f"{where} (computer_call_output) needs a 'call_id'", code="missing_required_parameter", param=f"{where}.call_id")
            output = item.get("output")
            if not isinstance(output, (dict, list)):
                raise bad_request(f"{where} (computer_call_output) needs an 'output' screenshot", code="missing_required_parameter", param=f"{where}.output")
            out.append(message_of("tool", output if isinstance(output, list) else [output], f"{where}.output", images=images, tool_call_id=cid))
        elif typ in compact.ITEM_TYPES:  # a compaction Splice answered earlier: its summary (responses_compact)
            flush()
            out.append(compact.expand(item, where)[0])
        elif typ == "item_reference":
            raise bad_request(f"{where}: unresolved item_reference", code="invalid_value", param=where)
        else:
            raise bad_request(
                f"{where} has type {typ!r}, which Splice does not support (supported: message, reasoning, "
                "function_call, function_call_output, computer_call_output, item_reference, compaction, compaction_trigger)",
                code="unsupported_input_item",
                param=where,
            )
    flush()
    return out, ids


class ResponseReader:
    """Where stored responses are read from (``proxy.store.ResponseTable`` or a test double)."""

    def get(self, response_id: str) -> tuple[bytes, bytes] | None: ...


def load_previous(store: ResponseReader, previous: str) -> list[Message]:
    """The stored conversation of ``previous_response_id``; 404 in OpenAI's shape if unknown."""
    got = store.get(previous)
    if got is None:
        raise APIError(404, f"Previous response with id '{previous}' not found.", code="previous_response_not_found", param="previous_response_id")
    _body, conversation = got
    return messages_from_json(conversation)


def resolve_item_references(store: ResponseReader, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Replace ``item_reference`` items by the output items of stored responses they name."""
    if not any(isinstance(it, dict) and it.get("type") == "item_reference" for it in items):
        return items
    cache: dict[str, dict[str, Any] | None] = {}
    out: list[dict[str, Any]] = []
    for i, it in enumerate(items):
        if not (isinstance(it, dict) and it.get("type") == "item_reference"):
            out.append(it)
            continue
        ref = it.get("id")
        turn = turn_id_from(ref) if isinstance(ref, str) else None
        found = None
        if turn is not None:
            rid = response_id(turn)
            if rid not in cache:
                got = store.get(rid)
                cache[rid] = orjson.loads(got[0]) if got is not None else None
            body = cache[rid]
            if body is not None:
                found = next((o for o in body.get("output", []) if o.get("id") == ref), None)
        if found is None:
            raise APIError(404, f"input[{i}]: item with id {ref!r} not found", code="item_not_found", param=f"input[{i}]")
        out.append(found)
    return out


# ============================================================================ request -> turn


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


def build_context(body: dict[str, Any], headers, runner: TurnRunner, store: ResponseReader, images: ImageRequest | None = None) -> ResponsesContext:
    req: ResponsesRequest = validate(ResponsesRequest, body)
    req.check_supported()
    ts = offer_tools(req.tools)
    tools, echo = ts.tools, ts.echo
    check_tool_choice(req.tool_choice, tools)
    items = req.input
    if isinstance(items, list):
        items = resolve_item_references(store, items)
    items, trigger = compact.split_trigger(items)
    msgs, ids = input_to_messages(items, ts, images)
    prev: list[Message] = []
    hints: list[str] = []
    if req.previous_response_id:
        check_id("previous_response_id", req.previous_response_id)
        prev = load_previous(store, req.previous_response_id)
        hints.append(req.previous_response_id)
    hints.extend(ids)
    history = name_tool_messages(prev + msgs)
    messages = ([Message(role="system", content=req.instructions)] if req.instructions else []) + history
    if not messages:
        raise bad_request("'input' is empty: nothing to respond to", code="invalid_value", param="input")
    if trigger:  # the summary turn of a compaction: the history plus the instruction, no tools offered
        messages, tools = compact.summary_messages(messages), []
    treq = turn_request(
        "responses", req, headers, model=runner.model_name, messages=messages, tools=tools, hints=hints, stop=[],
        max_output_tokens=req.max_output_tokens, not_offered=ts.not_offered, controls=responses_controls(req),
    )
    treq.compacted_from = compact.compacted_from(items)
    ctx = ResponsesContext(req=req, turn=treq, history=history, tools_echo=echo, fmt=runner.fmt, toolset=ts,
                           compaction_trigger=trigger)  # fmt: skip
    treq.present = ctx.present
    return ctx


def responses_controls(req: ResponsesRequest) -> dict[str, Any]:
    """What the request asks that would need constrained decoding (recorded, not enforced)."""
    fmt = (req.text or {}).get("format") if isinstance(req.text, dict) else None
    return {
        "tool_choice": tool_choice_control(req.tool_choice),
        "parallel_tool_calls": False if req.parallel_tool_calls is False else None,
        "text.format": fmt if isinstance(fmt, dict) and fmt.get("type") not in (None, "text") else None,
        "max_tool_calls": req.max_tool_calls,
    }


# ============================================================================ output


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


# ============================================================================ router


async def _iterate(frames: list[bytes]):
    for f in frames:
        yield f


def responses_router(runner: TurnRunner, store: ResponseReader, images: ImageInput | None = None) -> APIRouter:
    """``POST /v1/responses`` and ``GET /v1/responses/{response_id}``. ``images``: the app's
    image input (None: text only)."""
    from .responses_stream import stream_response

    router = APIRouter()

    @router.post("/v1/responses", openapi_extra=body_schema(ResponsesRequest))
    async def post_response(request: Request):
        body = parse_json_body(await request.body())
        req_images = await images.prepare(body) if images is not None else None
        ctx = build(build_context, body, request.headers, runner, store, req_images)
        if ctx.compaction_trigger and ctx.req.stream:  # one item, known once the summary is done
            result = await run_turn(runner, ctx.turn, request)
            frames = compact.trigger_events(response_skeleton(ctx, result.turn_id), result.body)
            return streaming_response(_iterate(frames), headers=splice_headers(result))
        if not ctx.req.stream:
            result = await run_turn(runner, ctx.turn, request)
            return JSONResponse(result.encoded, headers=splice_headers(result))
        stream = TurnStream(runner, ctx.turn)
        await stream.start(request)  # errors before the first token are plain HTTP errors
        return streaming_response(stream_response(ctx, stream), headers=stream.headers(), turn=stream)

    compact.register(router, runner, store, images, build_context)

    @router.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        got = store.get(response_id)
        if got is None:
            raise not_found(f"Response with id '{response_id}' not found.")
        return JSONResponse(bytes(got[0]))

    return router
