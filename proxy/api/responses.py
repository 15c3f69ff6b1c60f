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

from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import APIRouter, Request

from tokenization.conversation import Message, ToolCall

from ..errors import APIError, bad_request, not_found
from ..ids import response_id, turn_id_from
from ..session import TurnRunner
from .content import (
    ToolSet, check_tool_choice, custom_arguments, message_of, name_tool_messages, offer_tools, text_of, tool_choice_control,
)  # fmt: skip
from .context import check_id, conversation_of, header_map, turn_request
from .images import ImageInput, ImageRequest
from .history_memo import NOT_KEPT, Found, HistoryMemo, convert, read_body
from .jsonio import JSONResponse, body_schema, build, validate
from .models import ResponsesRequest
from .output import splice_headers
from .responses_conversation import message_from_dict, message_to_dict, messages_from_json, messages_to_json
from .responses_output import (
    ResponsesContext, build_output, finish_response, function_call_item, message_item, output_text_part, present_response,
    reasoning_item, response_skeleton, tool_call_item, wants_logprobs,
)  # fmt: skip
from .responses_stream import stream_response
from .streaming import TurnStream, run_turn, streaming_response
from . import responses_compact as compact

__all__ = [  # the stored conversation form and the output builders moved down; still importable here
    "ResponseReader", "ResponsesContext", "build_context", "build_output", "finish_response", "function_call_item",
    "input_to_messages", "load_previous", "message_from_dict", "message_item", "message_to_dict", "messages_from_json",
    "messages_to_json", "output_text_part", "present_response", "reasoning_item", "resolve_item_references",
    "response_skeleton", "responses_controls", "responses_router", "tool_call_item", "wants_logprobs",
]  # fmt: skip


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


class _InputConverter:
    """Responses input items -> ``Message``s, one item at a time (``history_memo.MergingConverter``):
    each call returns the messages the item completed and the ids it carries."""

    def __init__(self, tools: ToolSet | None = None, images: ImageRequest | None = None):
        self.tools, self.images = tools, images if images is not None else ImageRequest(None)
        self.pending: _PendingAssistant | None = None

    def at_start(self) -> bool:
        return self.pending is None

    def finish(self) -> tuple[Message, ...]:
        done, self.pending = self.pending, None
        return (done.message(),) if done is not None else ()

    def __call__(self, i: int, item: Any) -> tuple[tuple[Message, ...], tuple[str, ...]]:
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", code="invalid_value", param=where)
        typ = item.get("type")
        if typ is None and "role" in item:
            typ = "message"
        ids = tuple(v for v in (item.get("id"), item.get("call_id")) if isinstance(v, str) and v)
        pending = self.pending
        if typ == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise bad_request(f"{where}.role must be one of user, assistant, system, developer; got {role!r}", code="invalid_value", param=f"{where}.role")
            if "content" not in item:
                raise bad_request(f"{where} is a message without 'content'", code="missing_required_parameter", param=f"{where}.content")
            if role == "assistant":
                text = text_of(item.get("content"), f"{where}.content")
                done = self.finish() if pending is not None and (pending.content is not None or pending.tool_calls) else ()
                if self.pending is None:
                    self.pending = _PendingAssistant()
                self.pending.content = text
                return done, ids
            imgs = self.images if role == "user" else None
            return (*self.finish(), message_of(role, item.get("content"), f"{where}.content", images=imgs)), ids
        if typ == "reasoning":
            text = _reasoning_text(item, where)
            done = self.finish() if pending is not None and (pending.has_reasoning_item or pending.content is not None or pending.tool_calls) else ()
            if self.pending is None:
                self.pending = _PendingAssistant()
            self.pending.has_reasoning_item = True
            self.pending.reasoning = text
            return done, ids
        if typ in ("function_call", "custom_tool_call"):
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
            if self.tools is not None:
                name = self.tools.visible_name(item.get("namespace"), name)
            if self.pending is None:
                self.pending = _PendingAssistant()
            self.pending.tool_calls.append(ToolCall(id=cid, name=name, arguments=args))
            return (), ids
        if typ in ("function_call_output", "custom_tool_call_output"):
            done = self.finish()
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
            return (*done, message_of("tool", output, f"{where}.output", images=self.images, tool_call_id=cid)), ids
        if typ == "computer_call_output":
            done = self.finish()
            cid = item.get("call_id")
            if not isinstance(cid, str) or not cid:
                raise bad_request(f"{where} (computer_call_output) needs a 'call_id'", code="missing_required_parameter", param=f"{where}.call_id")
            output = item.get("output")
            if not isinstance(output, (dict, list)):
                raise bad_request(f"{where} (computer_call_output) needs an 'output' screenshot", code="missing_required_parameter", param=f"{where}.output")
            return (*done, message_of("tool", output if isinstance(output, list) else [output], f"{where}.output", images=self.images, tool_call_id=cid)), ids
        if typ in compact.ITEM_TYPES:  # a compaction Splice answered earlier: its summary (responses_compact)
            return (*self.finish(), compact.expand(item, where)[0]), ids
        if typ == "item_reference":
            raise bad_request(f"{where}: unresolved item_reference", code="invalid_value", param=where)
        raise bad_request(
            f"{where} has type {typ!r}, which Splice does not support (supported: message, reasoning, "
            "function_call, function_call_output, computer_call_output, item_reference, compaction, compaction_trigger)",
            code="unsupported_input_item",
            param=where,
        )


_TEXT_PARTS = frozenset(("input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text"))


def _text_only(content: Any) -> bool:
    return type(content) is str or (type(content) is list and all(type(p) is dict and p.get("type") in _TEXT_PARTS for p in content))


def keepable(item: Any) -> bool:
    """An input item ``history_memo`` may keep: its conversion depends on nothing but itself
    and the items before it (no image parts, no namespaced tool, nothing resolved from the store)."""
    if type(item) is not dict or item.get("namespace"):
        return False
    typ = item.get("type", "message" if "role" in item else None)
    if typ == "message":
        return _text_only(item.get("content"))
    if typ in ("function_call_output", "custom_tool_call_output"):
        return _text_only(item.get("output"))
    return typ in ("reasoning", "function_call", "custom_tool_call") or typ in compact.ITEM_TYPES


def input_to_messages(
    items: str | list[dict[str, Any]] | None, tools: ToolSet | None = None, images: ImageRequest | None = None
) -> tuple[list[Message], list[str]]:
    """Convert Responses input to messages; also return the ids the input carries, in order.

    Consecutive reasoning / assistant message / function_call items merge into one assistant
    message (the template renders them as one turn). ``input_image`` parts of user messages and
    of ``function_call_output`` / ``computer_call_output`` outputs become image parts through
    ``images`` (a text-only model's requests get a 400).
    """
    if items is None:
        return [], []
    if isinstance(items, str):
        return [Message(role="user", content=items)], []
    one = _InputConverter(tools, images)
    out: list[Message] = []
    ids: list[str] = []
    for i, item in enumerate(items):
        msgs, item_ids = one(i, item)
        out.extend(msgs)
        ids.extend(item_ids)
    out.extend(one.finish())
    return out, ids


_REFERENCE = frozenset(("item_reference",))


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
    if not compact.any_of_type(items, _REFERENCE) or not any(isinstance(it, dict) and it.get("type") == "item_reference" for it in items):
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


def memo_head(body: dict[str, Any]) -> Any:
    """``history_memo.read_body``'s ``head``: a conversation continued by ``previous_response_id``
    is not kept (its input is the few items it adds)."""
    return NOT_KEPT if body.get("previous_response_id") or type(body.get("input")) is not list else None


def build_context(body: dict[str, Any], headers, runner: TurnRunner, store: ResponseReader, images: ImageRequest | None = None,
                  memo: HistoryMemo | None = None, found: Found | None = None) -> ResponsesContext:  # fmt: skip
    """The turn a Responses request asks for. ``memo`` / ``found``: the conversation's last
    request's conversion, matched against ``body["input"]`` (``history_memo.read_body``)."""
    req: ResponsesRequest = validate(ResponsesRequest, body)
    req.check_supported()
    ts = offer_tools(req.tools)
    tools, echo = ts.tools, ts.echo
    check_tool_choice(req.tool_choice, tools)
    items = req.input
    if isinstance(items, list):
        items = resolve_item_references(store, items)
    items, trigger = compact.split_trigger(items)
    prev: list[Message] = []
    hints: list[str] = []
    if req.previous_response_id:
        check_id("previous_response_id", req.previous_response_id)
        prev = load_previous(store, req.previous_response_id)
        hints.append(req.previous_response_id)
    chars = None
    if found is not None and found.key is not None and isinstance(items, list):
        conv = convert(items, _InputConverter(ts, images), found.reuse)
        if memo is not None:
            memo.keep(found.key, body["input"], None, conv, found.reuse, found.cost, keepable, found.layout)
        history, ids = conv.messages, conv.ids  # tool messages named as they were converted
        n = len(req.instructions or "")
        chars = (conv.chars[0] + n, conv.chars[1] + n)  # the instructions are a system message
    else:
        msgs, ids = input_to_messages(items, ts, images)
        history = name_tool_messages(prev + msgs)
    hints.extend(ids)
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
    if chars is not None and not trigger:
        treq.message_chars = chars
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




# ============================================================================ router


async def _iterate(frames: list[bytes]):
    for f in frames:
        yield f


def responses_router(runner: TurnRunner, store: ResponseReader, images: ImageInput | None = None,
                     memo: HistoryMemo | None = None) -> APIRouter:  # fmt: skip
    """``POST /v1/responses`` and ``GET /v1/responses/{response_id}``. ``images``: the app's
    image input (None: text only). ``memo``: each conversation's last input, converted
    (proxy/api/history_memo.py)."""
    router = APIRouter()
    memo = memo if memo is not None else HistoryMemo()

    @router.post("/v1/responses", openapi_extra=body_schema(ResponsesRequest))
    async def post_response(request: Request):
        headers = header_map(request)
        body, found = read_body(await request.body(), memo, "responses", conversation_of(headers), memo_head, "input")
        req_images = await images.prepare(body) if images is not None else None
        ctx = build(build_context, body, headers, runner, store, req_images, memo, found)
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
