"""The seam between the front ends and the session layer.

A front end turns an HTTP request into a ``TurnRequest``; the session layer splices,
generates, parses and commits, and returns a ``TurnResult``. Before the commit it calls the
request's ``present`` with the result, so the dialect's final body (and, for the Responses
API, the stored response) is built — and proven serializable — before anything is stored,
and is committed in the same transaction as the turn. Streaming front ends pass
``on_tokens(ids, logprobs)``, awaited with each batch of output as the engine produces it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, Literal, Sequence

from engines.client import TokensCallback
from engines.types import Generation
from tokenization.conversation import Message, Tool, tools_fingerprint
from tokenization.parse import ParsedOutput

__all__ = ["Presentation", "TokensCallback", "TurnRequest", "TurnResult"]

Api = Literal["responses", "chat", "messages"]


@dataclass
class Presentation:
    """What a front end answers with for a finished turn."""

    body: dict[str, Any]  # the dialect's final response object
    encoded: bytes  # ``body`` as JSON: serialized before the commit, so a body that cannot be sent is never stored
    conversation: bytes | None = None  # stored with the turn when the dialect keeps responses (JSON)


@dataclass
class TurnRequest:
    api: Api
    messages: list[Message]  # the full history as the agent sent it (after previous_response_id expansion)
    turn_id: str  # chosen up front: streamed item ids are final from the first event
    tools: list[Tool] = field(default_factory=list)
    model: str = ""
    session_id: str | None = None  # X-Session-Id / metadata.session_id
    group_id: str | None = None
    group_size: int | None = None
    parent_hint: str | None = None  # a Splice-issued id that names the previous turn (resp_/msg_/rs_/fc_/call_)
    max_output_tokens: int | None = None
    temperature: float | None = None  # what the agent asked (recorded; see the sampling mode)
    top_p: float | None = None
    stop: list[str] = field(default_factory=list)
    chat_template_kwargs: dict | None = None
    metadata: dict = field(default_factory=dict)
    tools_not_offered: list[str] = field(default_factory=list)  # hosted tools the model was not offered (reported)
    controls_not_enforced: dict[str, Any] = field(default_factory=dict)  # recorded with the turn, reported, not enforced
    present: Callable[["TurnResult"], Presentation] | None = None
    session_resolved: str | None = None  # set by the session layer once the turn is planned
    history_edits_policy: Literal["fork", "keep"] | None = None  # X-Splice-History-Edits; None: the server's
    history_edits: tuple[str, ...] = ()  # set by the session layer: edits continued under "keep"
    role: str | None = None  # X-Splice-Role as declared; the session layer sets the role it recorded
    role_reason: str | None = None  # why the session layer chose the role (proxy.session.roles)
    compaction: str | None = None  # "summary" / "restart" when the call is part of a compaction (set by the planner)
    compacted_from: str | None = None  # the summary turn a Splice compaction item named (Responses API)
    message_chars: tuple[int, int] | None = None  # (all, kept) characters of ``messages``, when a front end counted them

    @cached_property
    def tools_key(self) -> str:
        """``tools_fingerprint(self.tools)``, computed once: every history fingerprint of the turn
        (when it is planned, and when its answer is committed) carries it."""
        return tools_fingerprint(self.tools)

    @cached_property
    def kwargs_key(self) -> str:
        """The template kwargs in one canonical form (part of the turn's history fingerprints)."""
        return repr(sorted((self.chat_template_kwargs or {}).items()))

    @cached_property
    def fingerprint_variant(self) -> bytes:
        """What the turn's fingerprint rows keep beside the history's digest: 8 bytes for the
        tools, 8 for the template kwargs (``proxy.store.fingerprints``). Computed once: read
        when the turn is planned and when its answer is committed."""
        tools = hashlib.blake2b(f"t:{self.tools_key}".encode(), digest_size=8).digest()
        return tools + hashlib.blake2b(f"k:{self.kwargs_key}".encode(), digest_size=8).digest()


@dataclass
class TurnResult:
    turn_id: str  # also the id stem for output items
    session_id: str
    response_id: str  # resp_... (Responses), chatcmpl-... (Chat), msg_... (Messages)
    prompt_ids: Sequence[int]  # the plan's int32 array
    generation: Generation
    parsed: ParsedOutput
    spliced: bool
    fork_reason: str | None
    created_at: float
    model: str
    role: str = "main"
    index: int = -1  # the turn's position in its session, known once committed
    drift_recorded: bool = False  # committed with ``drift`` set (the parent had drifted)
    body: dict[str, Any] | None = None  # the front end's presentation, as committed
    encoded: bytes | None = None  # ``body`` as JSON

    @property
    def finish_reason(self) -> str:
        return self.generation.finish_reason
