"""Request models for the OpenAI front ends, and the interfaces they run against.

The models accept what OpenAI accepts: unknown fields are kept and ignored, so a client that
sends newer parameters still works. What Splice cannot serve (``n > 1``, images, hosted
tools, background mode, ...) is rejected with a 400 that says what and where. Items and
messages stay plain dicts here; ``responses_api`` and ``chat_api`` validate them one by one
so an error can name the offending item (``input[3]``, ``messages[2].content[1]``).
"""

from __future__ import annotations

from typing import Any, Awaitable, Literal, Protocol, runtime_checkable

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from proxy.errors import APIError, bad_request
from proxy.ids import new_turn_id, turn_id_from
from proxy.turn_types import TokensCallback, TurnRequest, TurnResult

# ----------------------------------------------------------------------------- interfaces


@runtime_checkable
class TurnRunner(Protocol):
    """The session layer as the front ends see it.

    ``run`` splices, generates and commits one turn. ``on_tokens`` (when given) is awaited with
    each batch of new output ids as the engine produces them, before ``run`` returns.
    ``tokenizer``/``renderer`` are the ones the turn is rendered and parsed with (``renderer``
    may be ``None`` for the generic bridge). A runner may also set ``starts_in_reasoning``
    (bool) when its generation prompt opens ``<think>``; otherwise the front end probes the
    template once.
    """

    tokenizer: Any
    renderer: Any
    model_name: str

    def run(self, req: TurnRequest, on_tokens: TokensCallback | None = None) -> Awaitable[TurnResult]: ...


@runtime_checkable
class ResponseStore(Protocol):
    """Where Responses API objects live for ``GET /v1/responses/{id}`` and ``previous_response_id``.

    ``conversation`` is the JSON list of messages (see ``responses_api.messages_to_json``)
    that ``previous_response_id`` expands to. Methods may be sync or async.
    """

    def put_response(self, response_id: str, session_id: str, turn_id: str, body: bytes, conversation: bytes) -> Any: ...

    def get_response(self, response_id: str) -> Any: ...  # tuple[bytes, bytes] | None


# ----------------------------------------------------------------------------- parsing


def parse_json_body(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise bad_request("request body is empty; expected a JSON object", code="invalid_json")
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    return data


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


def validate(model: type[BaseModel], data: dict[str, Any]) -> Any:
    """``model.model_validate`` with pydantic errors turned into an OpenAI-shaped 400."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errs = e.errors(include_url=False)
        first = errs[0]
        # a union reports one error per branch; keep the location without the branch name
        loc = tuple(p for p in first.get("loc", ()) if not (isinstance(p, str) and ("[" in p or p in _BRANCHES)))
        where = _loc(loc) or "body"
        msg = first.get("msg", "invalid value")
        more = f" (and {len(errs) - 1} more error(s))" if len(errs) > 1 else ""
        raise APIError(400, f"invalid value for '{where}': {msg}{more}", code="invalid_value", param=where) from None


_BRANCHES = {"str", "list", "dict", "int", "float", "bool", "function-after", "list[str]", "list[dict[str,any]]"}


# ----------------------------------------------------------------------------- models


class _OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class ResponsesRequest(_OpenAIModel):
    """``POST /v1/responses``."""

    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    store: bool | None = True
    metadata: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    include: list[str] | None = None
    truncation: str | None = None
    user: str | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: int | None = None
    service_tier: str | None = None
    # extensions (vLLM / SGLang style)
    chat_template_kwargs: dict[str, Any] | None = None

    def check_supported(self) -> None:
        if self.background:
            raise bad_request("background responses are not supported by Splice", code="unsupported_parameter", param="background")
        if self.conversation is not None:
            raise bad_request(
                "'conversation' is not supported by Splice; use previous_response_id or send the full input",
                code="unsupported_parameter",
                param="conversation",
            )
        if self.prompt is not None:
            raise bad_request("reusable prompt templates ('prompt') are not supported by Splice", code="unsupported_parameter", param="prompt")
        if self.truncation not in (None, "disabled", "auto"):
            raise bad_request(f"invalid value for 'truncation': {self.truncation!r}", code="invalid_value", param="truncation")
        if self.input is None and self.previous_response_id is None:
            raise bad_request("'input' is required", code="missing_required_parameter", param="input")


class StreamOptions(_OpenAIModel):
    include_usage: bool | None = False
    include_obfuscation: bool | None = None


class ChatCompletionRequest(_OpenAIModel):
    """``POST /v1/chat/completions``."""

    model: str | None = None
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: Any = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    n: int | None = Field(default=1, ge=1)
    metadata: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    seed: int | None = None
    user: str | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    store: bool | None = None

    def check_supported(self) -> None:
        if (self.n or 1) > 1:
            raise bad_request("n > 1 is not supported by Splice; send one request per sample", code="unsupported_value", param="n")
        if not self.messages:
            raise bad_request("'messages' must contain at least one message", code="invalid_value", param="messages")
        if self.functions:
            raise bad_request("the deprecated 'functions' parameter is not supported; use 'tools'", code="unsupported_parameter", param="functions")
        if self.function_call is not None:
            raise bad_request("the deprecated 'function_call' parameter is not supported; use 'tool_choice'", code="unsupported_parameter", param="function_call")
        if self.logprobs is not True and self.top_logprobs:
            raise bad_request("'top_logprobs' requires 'logprobs': true", code="invalid_value", param="top_logprobs")
        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else self.stop
            if len(stops) > 16:
                raise bad_request("'stop' accepts at most 16 sequences", code="invalid_value", param="stop")
            if any(not s for s in stops):
                raise bad_request("'stop' sequences must be non-empty strings", code="invalid_value", param="stop")

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


Channel = Literal["reasoning", "content", "tool_call"]


# ----------------------------------------------------------------------------- session routing


def session_fields(headers, metadata: dict[str, Any] | None) -> tuple[str | None, str | None, int | None]:
    """``(session_id, group_id, group_size)`` from ``X-Session-Id`` / ``X-Group-Id`` /
    ``X-Group-Size`` headers, else ``metadata.session_id`` / ``group_id`` / ``group_size``."""
    meta = metadata or {}

    def pick(header: str, key: str) -> Any:
        v = headers.get(header) if headers is not None else None
        if v is None or v == "":
            v = meta.get(key)
        return v

    sid = pick("x-session-id", "session_id")
    gid = pick("x-group-id", "group_id")
    gsize = pick("x-group-size", "group_size")
    size: int | None = None
    if gsize is not None and gsize != "":
        try:
            size = int(str(gsize).strip())
        except ValueError:
            raise bad_request(f"group size must be a positive integer, got {gsize!r}", code="invalid_value", param="group_size") from None
        if size < 1:
            raise bad_request(f"group size must be a positive integer, got {gsize!r}", code="invalid_value", param="group_size")
    for name, v in (("session_id", sid), ("group_id", gid)):
        if v is not None and not isinstance(v, (str, int)):
            raise bad_request(f"{name} must be a string", code="invalid_value", param=name)
        if v is not None and len(str(v)) > 256:
            raise bad_request(f"{name} is longer than 256 characters", code="invalid_value", param=name)
    return (str(sid) if sid not in (None, "") else None, str(gid) if gid not in (None, "") else None, size)


def parent_hint(candidates: list[str]) -> str | None:
    """The turn id of the most recent Splice-issued id among ``candidates`` (oldest first)."""
    for cand in reversed(candidates):
        tid = turn_id_from(cand)
        if tid is not None:
            return tid
    return None


def turn_request(api, req, headers, runner, *, messages, tools, hints: list[str], stop: list[str]) -> TurnRequest:
    """The session layer's request, from either front end's validated body.

    The turn id is chosen up front so streamed item ids are final from the first event.
    """
    session_id, group_id, group_size = session_fields(headers, req.metadata)
    return TurnRequest(
        api=api,
        messages=messages,
        tools=tools,
        model=req.model or getattr(runner, "model_name", "") or "",
        session_id=session_id,
        group_id=group_id,
        group_size=group_size,
        parent_hint=parent_hint(hints),
        max_output_tokens=req.max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        stop=stop,
        chat_template_kwargs=req.chat_template_kwargs,
        metadata=dict(req.metadata or {}),
        turn_id=new_turn_id(),
    )
