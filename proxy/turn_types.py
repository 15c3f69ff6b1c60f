"""The seam between the OpenAI front ends and the session layer.

A front end (Responses or Chat Completions) turns an HTTP request into a ``TurnRequest``,
the session layer splices, generates and commits, and returns a ``TurnResult`` the front end
formats. Streaming front ends pass an ``on_tokens`` callback that receives output ids as the
engine produces them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Awaitable, Callable, Literal

from engines.types import Generation
from tokenization.conversation import Message, Tool
from tokenization.parse import ParsedOutput

TokensCallback = Callable[[list[int]], Awaitable[None]]


@dataclass
class TurnRequest:
    api: Literal["responses", "chat"]
    messages: list[Message]  # the full history as the agent sent it (after previous_response_id expansion)
    tools: list[Tool] = field(default_factory=list)
    model: str = ""
    session_id: str | None = None  # X-Session-Id / metadata.session_id
    group_id: str | None = None
    group_size: int | None = None
    parent_hint: str | None = None  # a Splice-issued id that names the previous turn (resp_/msg_/rs_/fc_/call_)
    max_output_tokens: int | None = None
    temperature: float | None = None  # what the agent asked (recorded; see sampling mode)
    top_p: float | None = None
    stop: list[str] = field(default_factory=list)
    chat_template_kwargs: dict | None = None
    metadata: dict = field(default_factory=dict)
    turn_id: str | None = None  # chosen up front by streaming front ends, whose first event names the ids


@dataclass
class TurnResult:
    turn_id: str  # also the id stem for output items
    session_id: str
    response_id: str  # resp_... (Responses) or chatcmpl-... (Chat)
    prompt_ids: list[int]
    generation: Generation
    parsed: ParsedOutput
    spliced: bool
    fork_reason: str | None
    created_at: float
    model: str

    @property
    def finish_reason(self) -> str:
        return self.generation.finish_reason
