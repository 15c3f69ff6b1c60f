"""OpenAI Chat Completions front end: ``POST /v1/chat/completions``.

Messages become Splice ``Message``s (assistant ``reasoning_content``/``reasoning`` kept,
``tool_calls`` kept with their ids, tool messages keyed by ``tool_call_id``). The reply's
``message.reasoning_content`` carries the reasoning (the vLLM / SGLang extension); tool
calls get ids ``call_{turn}_{k}`` so the next request names the turn it continues.
Streaming sends ``chat.completion.chunk``s: role, reasoning and content deltas as the engine
produces tokens, tool calls when the turn is parsed, the finish chunk, an optional usage
chunk (``stream_options.include_usage``) and ``data: [DONE]``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import orjson
from fastapi import APIRouter, Request

from tokenization.conversation import Message, ToolCall
from tokenization.incremental import CONTENT, REASONING, StopTextFilter, StrippedText

from ..errors import APIError, bad_request
from ..ids import call_id, chat_completion_id
from ..session import Presentation, TurnResult, TurnRunner
from .content import check_tool_choice, message_of, offer_tools, text_of, tool_choice_control
from .context import DialectContext, conversation_of, header_map, turn_request
from .images import ImageInput, ImageRequest
from .history_memo import ConvertItem, Found, HistoryMemo, convert, read_body
from .jsonio import JSONResponse, body_schema, build, dumps, validate
from .models import ChatCompletionRequest
from .output import splice_headers, splice_info, token_logprobs, usage_of
from .streaming import DONE, TurnStream, relay, run_turn, sse_data, streaming_response

log = logging.getLogger("splice.chat")

# ============================================================================ input conversion


def _tool_calls_of(raw: Any, where: str) -> tuple[ToolCall, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise bad_request(f"{where} must be a list", code="invalid_value", param=where)
    calls: list[ToolCall] = []
    for k, tc in enumerate(raw):
        w = f"{where}[{k}]"
        if not isinstance(tc, dict):
            raise bad_request(f"{w} must be an object", code="invalid_value", param=w)
        typ = tc.get("type", "function")
        if typ != "function":
            raise bad_request(f"{w} has type {typ!r}; only function tool calls are supported", code="unsupported_tool", param=w)
        fn = tc.get("function")
        if not isinstance(fn, dict):
            raise bad_request(f"{w} needs a 'function' object", code="missing_required_parameter", param=f"{w}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"{w}.function needs a 'name'", code="missing_required_parameter", param=f"{w}.function.name")
        args = fn.get("arguments", "")
        if args is None:
            args = ""
        if not isinstance(args, str):
            args = orjson.dumps(args).decode()
        cid = tc.get("id")
        if not isinstance(cid, str) or not cid:
            raise bad_request(f"{w} needs an 'id'", code="missing_required_parameter", param=f"{w}.id")
        calls.append(ToolCall(id=cid, name=name, arguments=args))
    return tuple(calls)


def messages_to_conversation(messages: list[dict[str, Any]], images: ImageRequest | None = None) -> tuple[list[Message], list[str]]:
    """Chat messages -> ``Message``s; also the tool-call ids they carry, in order.

    ``image_url`` parts of user and tool messages become image parts through ``images`` (a
    text-only model's requests get a 400)."""
    conv = convert(messages, _message_converter(images), None)
    return conv.messages, conv.ids


def keepable(m: Any) -> bool:
    """A message ``history_memo`` may keep: string (or no) content, so no image parts."""
    return type(m) is dict and (m.get("content") is None or type(m.get("content")) is str)


def _message_converter(images: ImageRequest | None) -> ConvertItem:
    images = images if images is not None else ImageRequest(None)

    def one(i: int, m: Any) -> tuple[tuple[Message, ...], tuple[str, ...]]:
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object", code="invalid_value", param=where)
        role = m.get("role")
        content = m.get("content")
        # Plain string content (the common case) needs no content-part parsing.
        if role in ("system", "developer", "user"):
            if content is None:
                raise bad_request(f"{where} ({role}) needs 'content'", code="missing_required_parameter", param=f"{where}.content")
            if isinstance(content, str):
                return (Message(role=role, content=content),), ()
            imgs = images if role == "user" else None
            return (message_of(role, content, f"{where}.content", images=imgs, allow_refusal=False),), ()
        if role == "assistant":
            calls = _tool_calls_of(m.get("tool_calls"), f"{where}.tool_calls")
            if m.get("function_call") is not None:
                raise bad_request(f"{where}.function_call is deprecated and not supported; use tool_calls", code="unsupported_parameter", param=f"{where}.function_call")
            reasoning = m.get("reasoning_content")
            if reasoning is None:
                reasoning = m.get("reasoning")
            if reasoning is not None and not isinstance(reasoning, str):
                raise bad_request(f"{where}.reasoning_content must be a string", code="invalid_value", param=f"{where}.reasoning_content")
            text = content if isinstance(content, str) else text_of(content, f"{where}.content")
            return (Message(role="assistant", content=text, reasoning=reasoning or None, tool_calls=calls),), tuple(tc.id for tc in calls)
        if role == "tool":
            tcid = m.get("tool_call_id")
            if not isinstance(tcid, str) or not tcid:
                raise bad_request(f"{where} (tool) needs a 'tool_call_id'", code="missing_required_parameter", param=f"{where}.tool_call_id")
            name = m.get("name") if isinstance(m.get("name"), str) else None
            if isinstance(content, str):
                return (Message(role="tool", content=content, tool_call_id=tcid, name=name),), (tcid,)
            return (message_of("tool", content, f"{where}.content", images=images, tool_call_id=tcid, name=name),), (tcid,)
        if role == "function":
            raise bad_request(f"{where}: the deprecated 'function' role is not supported; use 'tool'", code="unsupported_value", param=f"{where}.role")
        raise bad_request(f"{where}.role must be one of system, developer, user, assistant, tool; got {role!r}", code="invalid_value", param=f"{where}.role")

    return one


# ============================================================================ request -> turn


@dataclass
class ChatContext(DialectContext):
    req: ChatCompletionRequest
    created: int = field(default_factory=lambda: int(time.time()))

    def present(self, result: TurnResult) -> Presentation:
        body = completion_body(self, result)
        return Presentation(body=body, encoded=dumps(body))


def build_chat_context(body: dict[str, Any], headers, runner: TurnRunner, images: ImageRequest | None = None,
                       memo: HistoryMemo | None = None, found: Found | None = None) -> ChatContext:  # fmt: skip
    """The turn a chat request asks for. ``memo`` / ``found``: the conversation's last
    request's conversion, matched against ``body["messages"]`` (``read_body``)."""
    req: ChatCompletionRequest = validate(ChatCompletionRequest, body)
    req.check_supported()
    ts = offer_tools(req.tools, freeform_ok=False)
    tools = ts.tools
    check_tool_choice(req.tool_choice, tools)
    conv = convert(req.messages, _message_converter(images), found.reuse if found is not None else None)
    messages, ids = conv.messages, conv.ids
    if memo is not None and found is not None:
        memo.keep(found.key, body["messages"], None, conv, found.reuse, found.cost, keepable, found.layout)
    treq = turn_request(
        "chat", req, headers, model=runner.model_name, messages=messages, tools=tools, hints=ids, stop=req.stop_list,
        max_output_tokens=req.max_output_tokens, not_offered=ts.not_offered, controls=chat_controls(req),
    )
    treq.message_chars = conv.chars
    ctx = ChatContext(req=req, turn=treq, fmt=runner.fmt)
    treq.present = ctx.present
    return ctx


def chat_controls(req: ChatCompletionRequest) -> dict[str, Any]:
    """What the request asks that would need constrained decoding (recorded, not enforced)."""
    fmt = req.response_format
    return {
        "tool_choice": tool_choice_control(req.tool_choice),
        "parallel_tool_calls": False if req.parallel_tool_calls is False else None,
        "response_format": fmt if isinstance(fmt, dict) and fmt.get("type") not in (None, "text") else None,
    }


# ============================================================================ output


def finish_reason_of(result: TurnResult) -> str:
    if result.finish_reason == "length":
        return "length"
    if result.parsed.tool_calls:
        return "tool_calls"
    return "stop"


def chat_usage(ctx: ChatContext, result: TurnResult) -> dict[str, Any]:
    u = usage_of(ctx.fmt, result, ctx.turn.chat_template_kwargs)
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.output_tokens,
        "total_tokens": u.total_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
    }


def tool_call_dicts(turn_id: str, result: TurnResult) -> list[dict[str, Any]]:
    return [
        {"id": call_id(turn_id, k), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for k, c in enumerate(result.parsed.tool_calls)
    ]


def _logprobs_block(ctx: ChatContext, result: TurnResult) -> dict[str, Any] | None:
    if not ctx.req.logprobs:
        return None
    return {"content": token_logprobs(ctx.fmt, result), "refusal": None}


def completion_body(ctx: ChatContext, result: TurnResult) -> dict[str, Any]:
    tid = result.turn_id
    p = result.parsed
    calls = tool_call_dicts(tid, result)
    message: dict[str, Any] = {
        "role": "assistant",
        "content": p.content if (p.content or not calls) else None,
        "reasoning_content": p.reasoning,
        "refusal": None,
        "annotations": [],
    }
    if calls:
        message["tool_calls"] = calls
    return {
        "id": chat_completion_id(tid),
        "object": "chat.completion",
        "created": ctx.created,
        "model": result.model or ctx.model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": _logprobs_block(ctx, result),
                "finish_reason": finish_reason_of(result),
            }
        ],
        "usage": chat_usage(ctx, result),
        "service_tier": "default",
        "system_fingerprint": None,
        "splice": splice_info(result, ctx.turn),
    }


# ============================================================================ streaming


class ChunkWriter:
    def __init__(self, ctx: ChatContext, include_usage: bool):
        self.base = {
            "id": chat_completion_id(ctx.turn_id),
            "object": "chat.completion.chunk",
            "created": ctx.created,
            "model": ctx.model,
            "system_fingerprint": None,
        }
        self.include_usage = include_usage
        self.reasoning = StrippedText()
        self.content = StrippedText()
        self.stop = StopTextFilter(ctx.turn.stop)

    def chunk(self, delta: dict[str, Any], *, finish_reason: str | None = None, logprobs: Any = None, **extra: Any) -> bytes:
        data = dict(self.base)
        data["choices"] = [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]
        if self.include_usage:
            data["usage"] = None
        data.update(extra)
        return sse_data(data)

    def role(self) -> bytes:
        return self.chunk({"role": "assistant", "content": ""})

    def text(self, channel: str, text: str) -> bytes | None:
        if channel == REASONING:
            d = self.reasoning.push(text)
            return self.chunk({"reasoning_content": d}) if d else None
        if channel == CONTENT:
            d = self.content.push(self.stop.push(text))
            return self.chunk({"content": d}) if d else None
        return None

    def flush_stop(self) -> bytes | None:
        d = self.content.push(self.stop.flush())
        return self.chunk({"content": d}) if d else None


def stream_chat(ctx: ChatContext, stream: TurnStream) -> AsyncIterator[bytes]:
    """The chunk sequence; a failure after the first chunk ends it with an error chunk and [DONE]."""
    return relay(_chunks(ctx, stream), stream, _error_chunk, f"chat completion {chat_completion_id(ctx.turn_id)}")


def _error_chunk(err: APIError) -> bytes:
    return sse_data(err.body()) + DONE


async def _chunks(ctx: ChatContext, stream: TurnStream) -> AsyncIterator[bytes]:
    opts = ctx.req.stream_options
    w = ChunkWriter(ctx, bool(opts and opts.include_usage))
    dec = ctx.fmt.decoder(template_kwargs=ctx.turn.chat_template_kwargs)
    yield w.role()
    async for batch in stream.batches():
        frames = [f for ch, t in dec.feed(batch) if (f := w.text(ch, t)) is not None]
        if frames:
            yield b"".join(frames)
    frames = [f for ch, t in dec.finish() if (f := w.text(ch, t)) is not None]
    if (f := w.flush_stop()) is not None:
        frames.append(f)
    result = stream.result()
    p = result.parsed
    for stream_text, final, key in ((w.reasoning, p.reasoning or "", "reasoning_content"), (w.content, p.content, "content")):
        rest = stream_text.remainder(final)
        if rest:
            frames.append(w.chunk({key: rest}))
        elif rest is None:
            log.warning("streamed %s of %s differs from the parsed output", key, ctx.turn_id)
    for k, c in enumerate(p.tool_calls):
        cid = call_id(ctx.turn_id, k)
        frames.append(w.chunk({"tool_calls": [{"index": k, "id": cid, "type": "function", "function": {"name": c.name, "arguments": ""}}]}))
        frames.append(w.chunk({"tool_calls": [{"index": k, "function": {"arguments": c.arguments}}]}))
    frames.append(w.chunk({}, finish_reason=finish_reason_of(result), logprobs=result.body["choices"][0]["logprobs"], splice=splice_info(result, ctx.turn)))
    if w.include_usage:
        usage = dict(w.base, choices=[], usage=result.body["usage"])
        frames.append(sse_data(usage))
    frames.append(DONE)
    yield b"".join(frames)


# ============================================================================ router


def chat_router(runner: TurnRunner, images: ImageInput | None = None, memo: HistoryMemo | None = None) -> APIRouter:
    """``POST /v1/chat/completions``. ``images``: the app's image input (None: text only).
    ``memo``: each conversation's last request, converted (proxy/api/history_memo.py)."""
    router = APIRouter()
    memo = memo if memo is not None else HistoryMemo()

    @router.post("/v1/chat/completions", openapi_extra=body_schema(ChatCompletionRequest))
    async def post_chat(request: Request):
        headers = header_map(request)
        body, found = read_body(await request.body(), memo, "chat", conversation_of(headers))
        req_images = await images.prepare(body) if images is not None else None
        ctx = build(build_chat_context, body, headers, runner, req_images, memo, found)
        if not ctx.req.stream:
            result = await run_turn(runner, ctx.turn, request)
            return JSONResponse(result.encoded, headers=splice_headers(result))
        stream = TurnStream(runner, ctx.turn)
        await stream.start(request)
        return streaming_response(stream_chat(ctx, stream), headers=stream.headers(), turn=stream)

    return router
