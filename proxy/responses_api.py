"""OpenAI Responses API front end: ``POST /v1/responses``, ``GET /v1/responses/{id}``.

Input items become Splice ``Message``s the way the chat template sees one conversation:
a reasoning item, an assistant message and the function calls that follow them are ONE
assistant turn; ``function_call_output`` items are tool messages; ``instructions`` is a
system message in front. ``previous_response_id`` prepends the stored conversation of that
response (its input and its output, not its instructions, as OpenAI does).

Output follows OpenAI's Response object; streaming emits OpenAI's event sequence with
monotonically increasing ``sequence_number``. The final items always come from the turn's
parse of the sampled ids; streamed deltas add up to them.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response as HTTPResponse

from proxy.errors import APIError, bad_request, not_found
from proxy.ids import (
    call_id,
    function_call_item_id,
    message_id,
    reasoning_id,
    response_id,
    turn_id_from,
)
from proxy.schemas import ResponsesRequest, parse_json_body, turn_request, validate
from proxy.sse import TurnStream, dumps, run_turn, sse_event, streaming_response, to_api_error
from proxy.turn_types import TurnRequest, TurnResult
from tokenization.conversation import Message, Tool, ToolCall
from tokenization.incremental import (
    CONTENT,
    REASONING,
    IncrementalDecoder,
    StrippedText,
    default_stop_ids,
    generation_starts_in_reasoning,
    reasoning_token_count,
    token_bytes,
)

log = logging.getLogger("splice.responses")

# ============================================================================ conversation JSON


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
    return d


def message_from_dict(d: dict[str, Any]) -> Message:
    return Message(
        role=d["role"],
        content=d.get("content") or "",
        reasoning=d.get("reasoning"),
        tool_calls=tuple(ToolCall(tc["id"], tc["name"], tc["arguments"]) for tc in d.get("tool_calls") or ()),
        tool_call_id=d.get("tool_call_id"),
        name=d.get("name"),
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

_TEXT_PARTS = {"input_text", "output_text", "text", "summary_text", "reasoning_text"}
_UNSUPPORTED_PARTS = {"input_image", "input_file", "input_audio", "image_url", "image", "file", "audio"}
_ROLES = {"user", "system", "developer", "assistant"}


def _text_of(content: Any, where: str, *, allow_refusal: bool = True) -> str:
    """Text of a string or a list of content parts; images and files are rejected."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts", code="invalid_value", param=where)
    texts: list[str] = []
    for j, part in enumerate(content):
        pw = f"{where}[{j}]"
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise bad_request(f"{pw} must be a content part object", code="invalid_value", param=pw)
        typ = part.get("type")
        if typ in _TEXT_PARTS:
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_request(f"{pw} ({typ}) needs a string 'text'", code="invalid_value", param=pw)
            texts.append(text)
        elif typ == "refusal" and allow_refusal:
            texts.append(str(part.get("refusal") or ""))
        elif typ in _UNSUPPORTED_PARTS:
            raise bad_request(
                f"{pw} has type '{typ}': Splice serves text-only models; images, files and audio are not supported",
                code="unsupported_content",
                param=pw,
            )
        else:
            raise bad_request(f"{pw} has unsupported content part type {typ!r}", code="unsupported_content", param=pw)
    return "\n".join(texts)


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
        return _text_of(content, f"{where}.content") or None
    summary = item.get("summary")
    if summary:
        if not isinstance(summary, list):
            raise bad_request(f"{where}.summary must be a list", code="invalid_value", param=f"{where}.summary")
        parts = [s.get("text", "") if isinstance(s, dict) else str(s) for s in summary]
        return "\n\n".join(p for p in parts if p) or None
    return None  # encrypted_content only: nothing Splice can render


def input_to_messages(items: str | list[dict[str, Any]] | None) -> tuple[list[Message], list[str]]:
    """Convert Responses input to messages; also return the ids the input carries, in order.

    Consecutive reasoning / assistant message / function_call items merge into one assistant
    message (the template renders them as one turn).
    """
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
            text = _text_of(item.get("content"), f"{where}.content")
            if role == "assistant":
                if pending is not None and (pending.content is not None or pending.tool_calls):
                    flush()
                if pending is None:
                    pending = _PendingAssistant()
                pending.content = text
            else:
                flush()
                out.append(Message(role=role, content=text))
        elif typ == "reasoning":
            text = _reasoning_text(item, where)
            if pending is not None and (pending.has_reasoning_item or pending.content is not None or pending.tool_calls):
                flush()
            if pending is None:
                pending = _PendingAssistant()
            pending.has_reasoning_item = True
            pending.reasoning = text
        elif typ == "function_call":
            name = item.get("name")
            cid = item.get("call_id") or item.get("id")
            args = item.get("arguments", "")
            if not isinstance(name, str) or not name:
                raise bad_request(f"{where} (function_call) needs a 'name'", code="missing_required_parameter", param=f"{where}.name")
            if not isinstance(cid, str) or not cid:
                raise bad_request(f"{where} (function_call) needs a 'call_id'", code="missing_required_parameter", param=f"{where}.call_id")
            if not isinstance(args, str):
                args = orjson.dumps(args).decode()
            if pending is None:
                pending = _PendingAssistant()
            pending.tool_calls.append(ToolCall(id=cid, name=name, arguments=args))
        elif typ == "function_call_output":
            flush()
            cid = item.get("call_id")
            if not isinstance(cid, str) or not cid:
                raise bad_request(f"{where} (function_call_output) needs a 'call_id'", code="missing_required_parameter", param=f"{where}.call_id")
            if "output" not in item:
                raise bad_request(f"{where} (function_call_output) needs an 'output'", code="missing_required_parameter", param=f"{where}.output")
            output = item.get("output")
            if isinstance(output, (dict, int, float, bool)) and not isinstance(output, list):
                output = orjson.dumps(output).decode()
            text = _text_of(output, f"{where}.output")
            out.append(Message(role="tool", content=text, tool_call_id=cid))
        elif typ == "item_reference":
            raise bad_request(f"{where}: unresolved item_reference", code="invalid_value", param=where)
        else:
            raise bad_request(
                f"{where} has type {typ!r}, which Splice does not support (supported: message, reasoning, "
                "function_call, function_call_output, item_reference)",
                code="unsupported_input_item",
                param=where,
            )
    flush()
    return out, ids


def name_tool_messages(messages: list[Message]) -> list[Message]:
    """Give tool messages the function name of the call they answer (some templates show it)."""
    names: dict[str, str] = {}
    out: list[Message] = []
    for m in messages:
        for tc in m.tool_calls:
            names[tc.id] = tc.name
        if m.role == "tool" and m.name is None and m.tool_call_id in names:
            m = Message(role="tool", content=m.content, tool_call_id=m.tool_call_id, name=names[m.tool_call_id])
        out.append(m)
    return out


def convert_tools(tools: list[dict[str, Any]] | None) -> tuple[list[Tool], list[dict[str, Any]]]:
    """Flat function tools -> ``Tool``; also the normalized echo for the Response object."""
    if not tools:
        return [], []
    out: list[Tool] = []
    echo: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise bad_request(f"{where} must be an object", code="invalid_value", param=where)
        typ = t.get("type", "function")
        if typ != "function":
            raise bad_request(
                f"{where} has type {typ!r}: Splice runs the model itself and supports only function tools "
                "(hosted tools such as web_search or file_search are not available)",
                code="unsupported_tool",
                param=where,
            )
        spec = t.get("function") if isinstance(t.get("function"), dict) else t  # tolerate the Chat shape
        name = spec.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"{where} needs a 'name'", code="missing_required_parameter", param=f"{where}.name")
        if name in seen:
            raise bad_request(f"{where}: duplicate function name {name!r}", code="invalid_value", param=f"{where}.name")
        seen.add(name)
        params = spec.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"{where}.parameters must be a JSON schema object", code="invalid_value", param=f"{where}.parameters")
        desc = spec.get("description")
        if desc is not None and not isinstance(desc, str):
            raise bad_request(f"{where}.description must be a string", code="invalid_value", param=f"{where}.description")
        out.append(Tool(name=name, description=desc or "", parameters=params or {}))
        echo.append(
            {
                "type": "function",
                "name": name,
                "description": desc,
                "parameters": params,
                "strict": spec.get("strict", True) if spec.get("strict") is not None else True,
            }
        )
    return out, echo


def check_tool_choice(tool_choice: Any, tools: list[Tool], param: str = "tool_choice") -> None:
    if tool_choice is None:
        return
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise bad_request(f"invalid value for '{param}': {tool_choice!r} (expected none, auto, required or a function)", code="invalid_value", param=param)
        return
    if isinstance(tool_choice, dict):
        typ = tool_choice.get("type")
        if typ == "function":
            name = tool_choice.get("name") or (tool_choice.get("function") or {}).get("name")
            if not name or name not in {t.name for t in tools}:
                raise bad_request(f"'{param}' names function {name!r}, which is not in 'tools'", code="invalid_value", param=param)
            return
        if typ == "allowed_tools":
            return
        raise bad_request(f"'{param}' of type {typ!r} is not supported by Splice", code="invalid_value", param=param)
    raise bad_request(f"invalid value for '{param}'", code="invalid_value", param=param)


async def store_get(store, rid: str) -> tuple[bytes, bytes] | None:
    if store is None:
        return None
    fn = store.get_response
    if inspect.iscoroutinefunction(fn):
        return await fn(rid)
    return await asyncio.to_thread(fn, rid)


async def store_put(store, rid: str, session_id: str, turn_id: str, body: bytes, conversation: bytes) -> None:
    if store is None:
        return
    fn = store.put_response
    try:
        if inspect.iscoroutinefunction(fn):
            await fn(rid, session_id, turn_id, body, conversation)
        else:
            await asyncio.to_thread(fn, rid, session_id, turn_id, body, conversation)
    except Exception:  # noqa: BLE001 - the turn is committed; a failed store only loses GET/previous_response_id
        log.exception("storing response %s failed", rid)


async def load_previous(store, previous: str) -> list[Message]:
    """The stored conversation of ``previous_response_id``; 404 in OpenAI's shape if unknown."""
    got = await store_get(store, previous)
    if got is None:
        raise APIError(404, f"Previous response with id '{previous}' not found.", code="previous_response_not_found", param="previous_response_id")
    _body, conversation = got
    return messages_from_json(conversation)


async def resolve_item_references(store, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
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
                got = await store_get(store, rid)
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
class ResponsesContext:
    """Everything about one request the output side needs."""

    req: ResponsesRequest
    turn: TurnRequest
    history: list[Message]  # previous conversation + this input (without instructions)
    tools_echo: list[dict[str, Any]]
    turn_id: str  # the id stem promised to the client (streaming) / asked of the session layer
    created_at: float
    model: str


async def build_context(body: dict[str, Any], headers, runner, store) -> ResponsesContext:
    req: ResponsesRequest = validate(ResponsesRequest, body)
    req.check_supported()
    tools, echo = convert_tools(req.tools)
    check_tool_choice(req.tool_choice, tools)
    items = req.input
    if isinstance(items, list):
        items = await resolve_item_references(store, items)
    msgs, ids = input_to_messages(items)
    prev: list[Message] = []
    hints: list[str] = []
    if req.previous_response_id:
        prev = await load_previous(store, req.previous_response_id)
        hints.append(req.previous_response_id)
    hints.extend(ids)
    history = name_tool_messages(prev + msgs)
    messages = ([Message(role="system", content=req.instructions)] if req.instructions else []) + history
    if not messages:
        raise bad_request("'input' is empty: nothing to respond to", code="invalid_value", param="input")
    treq = turn_request("responses", req, headers, runner, messages=messages, tools=tools, hints=hints, stop=[])
    tid, model = treq.turn_id, treq.model
    return ResponsesContext(req=req, turn=treq, history=history, tools_echo=echo, turn_id=tid, created_at=time.time(), model=model)


# ============================================================================ output


def count_reasoning_tokens(tokenizer, output_ids: list[int], *, start_in_reasoning: bool = False, stop_ids=None) -> int:
    """Output tokens spent in the initial reasoning region (markers included)."""
    return reasoning_token_count(tokenizer, list(output_ids), start_in_reasoning=start_in_reasoning, stop_ids=stop_ids)


def usage_of(result: TurnResult, reasoning_tokens: int) -> dict[str, Any]:
    gen = result.generation
    n_in = len(result.prompt_ids) or gen.prompt_tokens
    n_out = len(gen.output_ids)
    return {
        "input_tokens": n_in,
        "input_tokens_details": {"cached_tokens": gen.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": n_out,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": n_in + n_out,
    }


def token_logprobs(tokenizer, result: TurnResult) -> list[dict[str, Any]]:
    """Per-token logprobs of the whole sampled output (OpenAI's logprob entry shape)."""
    gen = result.generation
    ids = list(gen.output_ids)
    if not ids:
        return []
    raw = token_bytes(tokenizer, ids)
    lps = list(gen.logprobs) + [0.0] * max(0, len(ids) - len(gen.logprobs))
    return [
        {"token": b.decode("utf-8", errors="replace"), "logprob": float(lp), "bytes": list(b), "top_logprobs": []}
        for b, lp in zip(raw, lps)
    ]


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


def returned_message(turn_id: str, result: TurnResult) -> Message:
    """The assistant message as the client will replay it (call ids derived from the turn)."""
    p = result.parsed
    calls = tuple(ToolCall(call_id(turn_id, k), c.name, c.arguments) for k, c in enumerate(p.tool_calls))
    return Message(role="assistant", content=p.content, reasoning=p.reasoning, tool_calls=calls)


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


def _wants_logprobs(req: ResponsesRequest) -> bool:
    return bool(req.include and "message.output_text.logprobs" in req.include)


def finish_response(body: dict[str, Any], ctx: ResponsesContext, result: TurnResult, output: list[dict[str, Any]], reasoning_tokens: int) -> dict[str, Any]:
    """Fill status, output, usage and the ``splice`` extension into a response skeleton."""
    length = result.finish_reason == "length"
    body = dict(body)
    body["status"] = "incomplete" if length else "completed"
    body["incomplete_details"] = {"reason": "max_output_tokens"} if length else None
    body["completed_at"] = int(time.time()) if not length else None
    body["model"] = result.model or ctx.model
    body["output"] = output
    body["usage"] = usage_of(result, reasoning_tokens)
    body["splice"] = {
        "session_id": result.session_id,
        "turn_id": result.turn_id,
        "spliced": result.spliced,
        "fork_reason": result.fork_reason,
        "finish_reason": result.finish_reason,
        "malformed_tool_calls": len(result.parsed.malformed_calls),
    }
    return body


def build_output(turn_id: str, result: TurnResult, logprobs: list | None = None) -> list[dict[str, Any]]:
    p = result.parsed
    status = "incomplete" if result.finish_reason == "length" else "completed"
    out: list[dict[str, Any]] = []
    if p.reasoning:
        out.append(reasoning_item(turn_id, p.reasoning))
    if p.content or not p.tool_calls:
        out.append(message_item(turn_id, p.content, status, logprobs))
    for k, c in enumerate(p.tool_calls):
        out.append(function_call_item(turn_id, k, c.name, c.arguments))
    return out


class _Probe:
    """Per-runner cache of whether generation starts inside reasoning."""

    def __init__(self) -> None:
        self._cache: dict[int, bool] = {}

    def __call__(self, runner) -> bool:
        explicit = getattr(runner, "starts_in_reasoning", None)
        if isinstance(explicit, bool):
            return explicit
        key = id(runner)
        if key not in self._cache:
            self._cache[key] = generation_starts_in_reasoning(getattr(runner, "tokenizer", None), getattr(runner, "renderer", None))
        return self._cache[key]


starts_in_reasoning = _Probe()


def stop_ids_of(runner) -> set[int]:
    renderer = getattr(runner, "renderer", None)
    if renderer is not None and hasattr(renderer, "get_stop_token_ids"):
        try:
            return set(renderer.get_stop_token_ids())
        except Exception:  # noqa: BLE001
            pass
    return default_stop_ids(runner.tokenizer)


def _reconcile_turn_id(ctx: ResponsesContext, result: TurnResult) -> None:
    if result.turn_id != ctx.turn_id:
        log.warning(
            "session layer assigned turn id %s instead of the requested %s; streamed ids keep the requested one",
            result.turn_id,
            ctx.turn_id,
        )


# ============================================================================ non-streaming


async def create_response(ctx: ResponsesContext, runner, store) -> dict[str, Any]:
    result = await run_turn(runner, ctx.turn)
    tid = result.turn_id
    tok = getattr(runner, "tokenizer", None)
    lp = token_logprobs(tok, result) if (_wants_logprobs(ctx.req) and tok is not None) else None
    output = build_output(tid, result, lp)
    rtoks = count_reasoning_tokens(tok, result.generation.output_ids, start_in_reasoning=starts_in_reasoning(runner), stop_ids=stop_ids_of(runner))
    body = finish_response(response_skeleton(ctx, tid), ctx, result, output, rtoks)
    await _store_result(store, ctx, result, tid, body)
    return body


async def _store_result(store, ctx: ResponsesContext, result: TurnResult, tid: str, body: dict[str, Any]) -> None:
    if ctx.req.store is False or store is None:
        return
    conversation = messages_to_json(ctx.history + [returned_message(tid, result)])
    await store_put(store, body["id"], result.session_id, tid, dumps(body), conversation)


# ============================================================================ streaming


class ResponseEventWriter:
    """Builds the SSE event sequence of one streamed response."""

    def __init__(self, skeleton: dict[str, Any], turn_id: str):
        self.seq = 0
        self.skeleton = skeleton
        self.turn_id = turn_id
        self.items: list[dict[str, Any]] = []  # final items, in output_index order
        self.rs_index: int | None = None
        self.rs_text = StrippedText()
        self.rs_closed = False
        self.msg_index: int | None = None
        self.msg_text = StrippedText()

    def event(self, typ: str, **fields: Any) -> bytes:
        data = {"type": typ, **fields, "sequence_number": self.seq}
        self.seq += 1
        return sse_event(typ, data)

    def start(self) -> list[bytes]:
        return [
            self.event("response.created", response=self.skeleton),
            self.event("response.in_progress", response=self.skeleton),
        ]

    # -- reasoning --------------------------------------------------------------------------
    def reasoning_delta(self, text: str) -> list[bytes]:
        out: list[bytes] = []
        if self.rs_closed:
            return out
        delta = self.rs_text.push(text)
        if not delta:
            return out
        if self.rs_index is None:
            out += self._open_reasoning()
        out.append(self.event("response.reasoning_text.delta", item_id=reasoning_id(self.turn_id), output_index=self.rs_index, content_index=0, delta=delta))
        return out

    def _open_reasoning(self) -> list[bytes]:
        self.rs_index = len(self.items)
        self.items.append(reasoning_item(self.turn_id, ""))
        item = {"id": reasoning_id(self.turn_id), "type": "reasoning", "summary": [], "content": []}
        rid = reasoning_id(self.turn_id)
        return [
            self.event("response.output_item.added", output_index=self.rs_index, item=item),
            self.event("response.content_part.added", item_id=rid, output_index=self.rs_index, content_index=0, part={"type": "reasoning_text", "text": ""}),
        ]

    def close_reasoning(self, final: str | None) -> list[bytes]:
        """End the reasoning item with ``final`` (the parse's text), or with what was streamed."""
        out: list[bytes] = []
        if self.rs_closed:
            return out
        self.rs_closed = True
        text = self.rs_text.sent if final is None else final
        if self.rs_index is None:
            if not text:
                return out
            out += self._open_reasoning()
        rid = reasoning_id(self.turn_id)
        rest = self.rs_text.remainder(text)
        if rest:
            out.append(self.event("response.reasoning_text.delta", item_id=rid, output_index=self.rs_index, content_index=0, delta=rest))
        elif rest is None:
            log.warning("streamed reasoning of %s differs from the parsed reasoning", self.turn_id)
        item = reasoning_item(self.turn_id, text)
        self.items[self.rs_index] = item
        out += [
            self.event("response.reasoning_text.done", item_id=rid, output_index=self.rs_index, content_index=0, text=text),
            self.event("response.content_part.done", item_id=rid, output_index=self.rs_index, content_index=0, part={"type": "reasoning_text", "text": text}),
            self.event("response.output_item.done", output_index=self.rs_index, item=item),
        ]
        return out

    # -- message ----------------------------------------------------------------------------
    def _open_message(self) -> list[bytes]:
        self.msg_index = len(self.items)
        mid = message_id(self.turn_id)
        self.items.append(message_item(self.turn_id, "", "in_progress"))
        item = {"id": mid, "type": "message", "role": "assistant", "status": "in_progress", "content": []}
        return [
            self.event("response.output_item.added", output_index=self.msg_index, item=item),
            self.event("response.content_part.added", item_id=mid, output_index=self.msg_index, content_index=0, part=output_text_part("")),
        ]

    def content_delta(self, text: str) -> list[bytes]:
        out: list[bytes] = []
        delta = self.msg_text.push(text)
        if not delta:
            return out
        if not self.rs_closed:
            out += self.close_reasoning(None)
        if self.msg_index is None:
            out += self._open_message()
        out.append(self.event("response.output_text.delta", item_id=message_id(self.turn_id), output_index=self.msg_index, content_index=0, delta=delta, logprobs=[]))
        return out

    def close_message(self, final: str, status: str, logprobs: list | None) -> list[bytes]:
        out: list[bytes] = []
        if self.msg_index is None:
            out += self._open_message()
        mid = message_id(self.turn_id)
        rest = self.msg_text.remainder(final)
        if rest:
            out.append(self.event("response.output_text.delta", item_id=mid, output_index=self.msg_index, content_index=0, delta=rest, logprobs=[]))
        elif rest is None:
            log.warning("streamed text of %s differs from the parsed text", self.turn_id)
        part = output_text_part(final, logprobs)
        item = message_item(self.turn_id, final, status, logprobs)
        self.items[self.msg_index] = item
        out += [
            self.event("response.output_text.done", item_id=mid, output_index=self.msg_index, content_index=0, text=final, logprobs=logprobs or []),
            self.event("response.content_part.done", item_id=mid, output_index=self.msg_index, content_index=0, part=part),
            self.event("response.output_item.done", output_index=self.msg_index, item=item),
        ]
        return out

    # -- function calls -------------------------------------------------------------------
    def function_call(self, k: int, name: str, arguments: str) -> list[bytes]:
        idx = len(self.items)
        final = function_call_item(self.turn_id, k, name, arguments)
        self.items.append(final)
        fid = final["id"]
        added = dict(final, arguments="", status="in_progress")
        return [
            self.event("response.output_item.added", output_index=idx, item=added),
            self.event("response.function_call_arguments.delta", item_id=fid, output_index=idx, delta=arguments),
            self.event("response.function_call_arguments.done", item_id=fid, output_index=idx, name=name, arguments=arguments),
            self.event("response.output_item.done", output_index=idx, item=final),
        ]

    # -- end --------------------------------------------------------------------------------
    def finish(self, body: dict[str, Any]) -> bytes:
        typ = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        return self.event(typ, response=body)

    def failed(self, err: APIError) -> bytes:
        body = dict(self.skeleton)
        body["status"] = "failed"
        body["output"] = [it for it in self.items]
        body["error"] = {"code": err.code or "server_error", "message": err.message}
        return self.event("response.failed", response=body)


async def stream_response(ctx: ResponsesContext, runner, store, stream: TurnStream) -> AsyncIterator[bytes]:
    tid = ctx.turn_id
    w = ResponseEventWriter(response_skeleton(ctx, tid), tid)
    tok = runner.tokenizer
    in_reasoning = starts_in_reasoning(runner)
    stops = stop_ids_of(runner)
    dec = IncrementalDecoder(tok, start_in_reasoning=in_reasoning, stop_ids=stops)
    try:
        for chunk in w.start():
            yield chunk
        async for batch in stream.batches():
            frames: list[bytes] = []
            for channel, text in dec.feed(batch):
                frames += _channel_frames(w, dec, channel, text)
            if frames:
                yield b"".join(frames)
        frames = []
        for channel, text in dec.finish():
            frames += _channel_frames(w, dec, channel, text)
        result = stream.result()
        _reconcile_turn_id(ctx, result)
        p = result.parsed
        status = "incomplete" if result.finish_reason == "length" else "completed"
        lp = token_logprobs(tok, result) if _wants_logprobs(ctx.req) else None
        if p.reasoning or w.rs_index is not None:
            frames += w.close_reasoning(p.reasoning or "")
            if w.rs_index is not None and w.items[w.rs_index]["content"][0]["text"] != (p.reasoning or ""):
                log.warning("streamed reasoning of %s differs from the parsed reasoning", tid)
        w.rs_closed = True
        if p.content or not p.tool_calls or w.msg_index is not None:
            frames += w.close_message(p.content, status, lp)
        for k, c in enumerate(p.tool_calls):
            frames += w.function_call(k, c.name, c.arguments)
        rtoks = count_reasoning_tokens(tok, result.generation.output_ids, start_in_reasoning=in_reasoning, stop_ids=stops)
        body = finish_response(w.skeleton, ctx, result, list(w.items), rtoks)
        await _store_result(store, ctx, result, tid, body)
        frames.append(w.finish(body))
        yield b"".join(frames)
    except asyncio.CancelledError:
        stream.cancel()
        raise
    except Exception as exc:  # noqa: BLE001 - after the stream started, errors go in-band
        err = to_api_error(exc)
        log.warning("streamed response %s failed: %s", response_id(tid), err.message)
        yield w.failed(err)
    finally:
        stream.cancel()


def _channel_frames(w: ResponseEventWriter, dec: IncrementalDecoder, channel: str, text: str) -> list[bytes]:
    if channel == REASONING:
        return w.reasoning_delta(text)
    if channel == CONTENT:
        return w.content_delta(text)
    # tool-call text: the calls are emitted from the parse at the end; reasoning is over
    return w.close_reasoning(None) if not w.rs_closed and w.rs_index is not None else []


# ============================================================================ router


def _json(body: dict[str, Any] | bytes, status: int = 200) -> HTTPResponse:
    return HTTPResponse(content=body if isinstance(body, bytes) else dumps(body), status_code=status, media_type="application/json")


def responses_router(runner, store) -> APIRouter:
    """``POST /v1/responses`` and ``GET /v1/responses/{response_id}`` over ``runner`` and ``store``."""
    router = APIRouter()

    @router.post("/v1/responses")
    async def post_response(request: Request):
        body = parse_json_body(await request.body())
        ctx = await build_context(body, request.headers, runner, store)
        if not ctx.req.stream:
            return _json(await create_response(ctx, runner, store))
        stream = TurnStream(runner, ctx.turn)
        await stream.start()  # errors before the first token are plain HTTP errors
        return streaming_response(stream_response(ctx, runner, store, stream))

    @router.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        got = await store_get(store, response_id)
        if got is None:
            raise not_found(f"Response with id '{response_id}' not found.")
        return _json(bytes(got[0]))

    return router
