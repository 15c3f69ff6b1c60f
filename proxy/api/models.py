"""Request bodies of every route, as pydantic models.

The OpenAI models accept what OpenAI accepts: unknown fields are kept and ignored, so a client
that sends newer parameters still works. What Splice cannot serve (``n > 1``, images, hosted
tools, background mode, ...) is rejected with a 400 that says what and where. Items and
messages stay plain dicts here; the dialect modules validate them one by one so an error can
name the offending item (``input[3]``, ``messages[2].content[1]``).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from ..errors import bad_request

# The messages as parsed, not copied: the dialect checks each is an object where it converts it
# (naming the item), and an agent's history of hundreds of messages was copied dict by dict
# here on every turn. The schema still says objects.
Messages = Annotated[list[Any], Field(json_schema_extra={"items": {"type": "object"}})]

# Every integer a client sends is bounded: they reach SQLite (int64), orjson (64-bit) and the
# engines (int32 token budgets); a version or budget this large is always a mistake.
MAX_INT32 = 2**31 - 1


class _OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class ResponsesRequest(_OpenAIModel):
    """``POST /v1/responses``."""

    model: str | None = None
    input: str | Messages | None = None  # items kept as parsed (converting them checks each one)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
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
    max_tool_calls: int | None = Field(default=None, ge=0, le=MAX_INT32)
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
    messages: Messages
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: Any = None
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    n: int | None = Field(default=1, ge=1, le=128)
    metadata: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
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


class MessagesRequest(BaseModel):
    """``POST /v1/messages`` (unknown fields are kept and ignored, as Anthropic's beta fields come and go)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: Messages
    system: str | list[dict[str, Any]] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extension, as on the other two APIs

    def check_supported(self, *, counting: bool = False) -> None:
        if not counting and self.max_tokens is None:
            raise bad_request("max_tokens: Field required", param="max_tokens")
        if not self.messages:
            raise bad_request("messages: at least one message is required", param="messages")
        if self.stop_sequences is not None and any(not isinstance(s, str) or not s for s in self.stop_sequences):
            raise bad_request("stop_sequences: each stop sequence must be a non-empty string", param="stop_sequences")
        if self.thinking is not None and self.thinking.get("type") not in ("enabled", "disabled", "adaptive"):
            raise bad_request("thinking.type: expected 'enabled', 'disabled' or 'adaptive'", param="thinking.type")


# ----------------------------------------------------------------------------- trainer side


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


MAX_ABS_REWARD = 1e6  # the trainer squares rewards (group std): 1e200 overflows a float


class RewardBody(_Body):
    # A JSON number only (strict: "1.5" and true are refused); NaN or inf would poison every
    # advantage in its group, and so would a finite reward too large to square.
    reward: float = Field(allow_inf_nan=False, strict=True, ge=-MAX_ABS_REWARD, le=MAX_ABS_REWARD)


class PullBody(_Body):
    max_samples: int = Field(default=64, ge=1, le=100_000)
    wait_s: float = Field(default=0.0, ge=0.0, le=3600.0)


class AckBody(_Body):
    lease_id: str = Field(max_length=256)


class UpdateWeightsBody(_Body):
    model_path: str = Field(max_length=4096)
    version: int = Field(ge=0, le=MAX_INT32, strict=True)


class VersionBody(_Body):
    version: int = Field(ge=0, le=MAX_INT32, strict=True)
