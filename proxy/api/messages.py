"""Anthropic Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A third dialect over the same core and session layer: ``system`` (a string or text blocks) is a
system message in front; a user message's ``tool_result`` blocks are tool messages (in order,
then its text); an assistant message's ``thinking`` / ``text`` / ``tool_use`` blocks are ONE
assistant turn (reasoning, content, tool calls). ``redacted_thinking`` carries nothing Splice
can render and is dropped; ``cache_control`` is accepted and ignored.

The reply is a ``message`` whose content is the turn's parse of the sampled ids: a ``thinking``
block (signed with the turn id), a ``text`` block, ``tool_use`` blocks ``toolu_{turn}_{k}``.
Errors on these routes are Anthropic-shaped (``{"type": "error", "error": {...}}``);
streaming is ``messages_stream``.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request

from tokenization.conversation import Message, ToolCall

from ..errors import APIError, bad_request
from ..session import TurnRunner
from .content import ToolSet, offer_tools, parts_of, text_of
from .context import conversation_of, header_map, turn_request
from .images import ImageInput, ImageRequest
from .history_memo import ConvertItem, Found, HistoryMemo, convert, read_body
from .jsonio import JSONResponse, body_schema, build, parse_json_body, validate
from .messages_errors import anthropic_error, error_response, is_messages_path
from .messages_output import (
    MessagesContext, content_blocks, message_body, message_skeleton, message_usage, stop_reason_of, tool_input,
)  # fmt: skip
from .messages_stream import stream_message
from .models import MessagesRequest
from .output import splice_headers
from .streaming import TurnStream, run_turn, streaming_response

__all__ = [  # the request model, the error shape and the output builders moved down; still importable here
    "MessagesContext", "MessagesRequest", "anthropic_error", "build_messages_context", "content_blocks", "count_tokens",
    "error_response", "is_messages_path", "message_body", "message_skeleton", "message_usage", "messages_controls",
    "messages_router", "messages_to_conversation", "stop_reason_of", "tool_input",
]  # fmt: skip

# ============================================================================ request


def _system_text(system: str | list[dict[str, Any]] | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    parts = []
    for i, block in enumerate(system):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise bad_request(f"system[{i}]: system blocks must be text blocks", param=f"system[{i}]")
        parts.append(block["text"])
    return "\n\n".join(parts)


def _tool_result_parts(block: dict[str, Any], where: str, images: ImageRequest) -> list:
    content = block.get("content")
    if content is None or isinstance(content, str):
        return [content or ""]
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of blocks", param=f"{where}.content")
    return parts_of(content, f"{where}.content", images=images, allow_refusal=False)


def _assistant(content: Any, where: str, ids: list[str]) -> Message:
    if isinstance(content, str):
        return Message(role="assistant", content=content)
    reasoning: list[str] = []
    texts: list[str] = []
    calls: list[ToolCall] = []
    for j, block in enumerate(content):
        bw = f"{where}.content[{j}]"
        typ = block.get("type")
        if typ == "text":
            texts.append(str(block.get("text") or ""))
        elif typ == "thinking":
            reasoning.append(str(block.get("thinking") or ""))
            if isinstance(block.get("signature"), str):
                ids.append(block["signature"])
        elif typ == "redacted_thinking":
            continue  # opaque data: nothing a template can render
        elif typ in ("tool_use", "server_tool_use"):
            tid, name, args = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(tid, str) or not tid or not isinstance(name, str) or not name:
                raise bad_request(f"{bw} (tool_use) needs an 'id' and a 'name'", param=bw)
            calls.append(ToolCall(id=tid, name=name, arguments=orjson.dumps(args).decode()))
            ids.append(tid)
        else:
            raise bad_request(f"{bw} has type {typ!r}, which an assistant message cannot carry here", code="unsupported_content", param=bw)
    return Message(role="assistant", content="".join(texts), reasoning="".join(reasoning) or None, tool_calls=tuple(calls))


def _user(content: Any, where: str, ids: list[str], images: ImageRequest) -> list[Message]:
    if isinstance(content, str):
        return [Message(role="user", content=content)]
    out: list[Message] = []
    texts: list = []  # text and image parts of the user message being built
    for j, block in enumerate(content):
        bw = f"{where}.content[{j}]"
        typ = block.get("type")
        if typ == "tool_result":
            if texts:
                out.append(Message.from_parts("user", texts))
                texts = []
            tid = block.get("tool_use_id")
            if not isinstance(tid, str) or not tid:
                raise bad_request(f"{bw} (tool_result) needs a 'tool_use_id'", param=f"{bw}.tool_use_id")
            ids.append(tid)
            out.append(Message.from_parts("tool", _tool_result_parts(block, bw, images), tool_call_id=tid))
        elif typ == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif typ == "image":
            texts.append(images.image(block, bw))
        else:
            raise bad_request(
                f"{bw} has type {typ!r}: Splice takes text, image and tool_result blocks in user messages",
                code="unsupported_content", param=bw,
            )  # fmt: skip
    if texts or not out:
        out.append(Message.from_parts("user", texts))
    return out


def messages_to_conversation(system: Any, messages: list[dict[str, Any]], images: ImageRequest | None = None) -> tuple[list[Message], list[str]]:
    """Anthropic messages -> ``Message``s; also the Splice-issued ids they carry, in order.

    ``image`` blocks of user messages and of ``tool_result`` content become image parts through
    ``images`` (a text-only model's requests get a 400)."""
    sys_text = _system_text(system)
    conv = convert(messages, _message_converter(images), None)
    return _with_system(sys_text, conv.messages), conv.ids


def _head(system: Any) -> str | None:
    """The system text a kept conversion must share (None while the system is invalid)."""
    try:
        return _system_text(system)
    except (APIError, TypeError, AttributeError):  # validation reports it, in its own words
        return None


def _with_system(sys_text: str, messages: list[Message]) -> list[Message]:
    return [Message(role="system", content=sys_text), *messages] if sys_text else messages


def keepable(m: Any) -> bool:
    """A message ``history_memo`` may keep: no image blocks (resolved per request)."""
    if type(m) is not dict:
        return False
    content = m.get("content")
    if type(content) is str:
        return True
    if type(content) is not list:
        return False
    for b in content:
        if type(b) is not dict or b.get("type") == "image":
            return False
        if b.get("type") == "tool_result" and type(inner := b.get("content")) is list:
            if any(type(x) is not dict or x.get("type") == "image" for x in inner):
                return False
    return True


def _message_converter(images: ImageRequest | None) -> ConvertItem:
    images = images if images is not None else ImageRequest(None)

    def one(i: int, m: Any) -> tuple[list[Message], list[str]]:
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object", param=where)
        role, content = m.get("role"), m.get("content")
        if not isinstance(content, (str, list)) or (isinstance(content, list) and not all(isinstance(b, dict) for b in content)):
            raise bad_request(f"{where}.content must be a string or a list of content blocks", param=f"{where}.content")
        ids: list[str] = []
        if role == "assistant":
            return [_assistant(content, where, ids)], ids
        if role == "user":
            return _user(content, where, ids, images), ids
        if role == "system":  # Claude Code's mid-conversation system messages
            return [Message(role="system", content=text_of(content, f"{where}.content"))], ids
        raise bad_request(f"{where}.role: expected 'user' or 'assistant', got {role!r}", param=f"{where}.role")

    return one


def check_tool_choice(tool_choice: dict[str, Any] | None, ts: ToolSet) -> None:
    if tool_choice is None:
        return
    typ = tool_choice.get("type")
    if typ not in ("auto", "any", "tool", "none"):
        raise bad_request(f"tool_choice.type: expected auto, any, tool or none, got {typ!r}", param="tool_choice.type")
    if typ == "tool" and tool_choice.get("name") not in {t.name for t in ts.tools}:
        raise bad_request(f"tool_choice names tool {tool_choice.get('name')!r}, which is not in 'tools'", param="tool_choice.name")


def messages_controls(req: MessagesRequest) -> dict[str, Any]:
    """What the request asks that Splice records but does not enforce: forcing or forbidding
    tool use and one call per turn need constrained decoding (``none`` would also change the
    rendered tools, a fork); top_k and a thinking budget would change the sampling distribution;
    whether the model thinks is the chat template's (``chat_template_kwargs`` sets it)."""
    tc = req.tool_choice or {}
    thinking = req.thinking if req.thinking and req.thinking.get("type") in ("enabled", "disabled") else None
    extra = req.model_extra or {}
    out_cfg = extra.get("output_config")
    out_fmt = out_cfg.get("format") if isinstance(out_cfg, dict) else extra.get("output_format")
    return {
        "output_config.format": out_fmt if isinstance(out_fmt, dict) and out_fmt.get("type") not in (None, "text") else None,
        "tool_choice": tc if tc.get("type") in ("any", "tool", "none") else None,
        "disable_parallel_tool_use": True if tc.get("disable_parallel_tool_use") else None,
        "top_k": req.top_k,
        "thinking": thinking,
    }






def build_messages_context(body: dict[str, Any], headers, runner: TurnRunner, images: ImageRequest | None = None,
                           memo: HistoryMemo | None = None, found: Found | None = None) -> MessagesContext:  # fmt: skip
    """The turn a Messages request asks for. ``memo`` / ``found``: the conversation's last
    request's conversion, matched against ``body["messages"]`` and the system text (``read_body``)."""
    req: MessagesRequest = validate(MessagesRequest, body)
    req.check_supported()
    ts = offer_tools(req.tools)
    check_tool_choice(req.tool_choice, ts)
    sys_text = _system_text(req.system)
    reuse = found.reuse if found is not None else None
    conv = convert(req.messages, _message_converter(images), reuse)
    messages, ids = _with_system(sys_text, conv.messages), conv.ids
    if memo is not None and found is not None:
        memo.keep(found.key, body["messages"], sys_text, conv, reuse, found.cost, keepable, found.layout)
    treq = turn_request(
        "messages", req, headers, model=runner.model_name, messages=messages, tools=ts.tools, hints=ids,
        stop=list(req.stop_sequences or []), max_output_tokens=req.max_tokens, not_offered=ts.not_offered,
        controls=messages_controls(req),
    )  # fmt: skip
    treq.message_chars = (conv.chars[0] + len(sys_text), conv.chars[1] + len(sys_text))  # with the system message
    ctx = MessagesContext(req=req, turn=treq, fmt=runner.fmt, toolset=ts)
    treq.present = ctx.present
    return ctx






# ============================================================================ count_tokens


def count_tokens(body: dict[str, Any], runner: TurnRunner, images: ImageRequest | None = None) -> dict[str, int]:
    """The prompt a first turn of this conversation would have: the chat template's full render
    (each image counted as its expanded placeholder span)."""
    req: MessagesRequest = validate(MessagesRequest, body)
    req.check_supported(counting=True)
    ts = offer_tools(req.tools)
    messages, _ = messages_to_conversation(req.system, req.messages, images)
    try:
        ids = runner.fmt.render(messages, ts.tools, template_kwargs=req.chat_template_kwargs)
    except Exception as exc:  # noqa: BLE001 - any template failure is the conversation's fault
        raise APIError(400, f"the chat template cannot render this conversation: {exc}", code="invalid_messages") from None
    return {"input_tokens": len(ids)}


# ============================================================================ router


def messages_router(runner: TurnRunner, images: ImageInput | None = None, memo: HistoryMemo | None = None) -> APIRouter:
    """``POST /v1/messages`` and ``POST /v1/messages/count_tokens``; errors in Anthropic's shape.
    ``images``: the app's image input (None: text only). ``memo``: each conversation's last
    request, converted (proxy/api/history_memo.py)."""
    router = APIRouter()
    memo = memo if memo is not None else HistoryMemo()

    @router.post("/v1/messages", openapi_extra=body_schema(MessagesRequest))
    async def post_message(request: Request):
        try:
            headers = header_map(request)
            body, found = read_body(await request.body(), memo, "messages", conversation_of(headers),
                                    lambda b: _head(b.get("system")))  # fmt: skip
            req_images = await images.prepare(body) if images is not None else None
            ctx = build(build_messages_context, body, headers, runner, req_images, memo, found)
            if not ctx.req.stream:
                result = await run_turn(runner, ctx.turn, request)
                return JSONResponse(result.encoded, headers=splice_headers(result))
            stream = TurnStream(runner, ctx.turn)
            await stream.start(request)  # errors before the first token are plain HTTP errors
        except APIError as exc:
            return error_response(exc)
        return streaming_response(stream_message(ctx, stream), headers=stream.headers(), turn=stream)

    @router.post("/v1/messages/count_tokens")
    async def post_count_tokens(request: Request):
        try:
            body = parse_json_body(await request.body())
            req_images = await images.prepare(body) if images is not None else None
            return JSONResponse(count_tokens(body, runner, req_images))
        except APIError as exc:
            return error_response(exc)

    return router
