"""From a validated request to the session layer's ``TurnRequest``: session and group fields
(headers first, then ``metadata``, then the conversation id a known client sends on its own),
the Splice id that names the previous turn, the turn id."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import orjson

from tokenization import ChatFormat

from ..errors import bad_request
from ..ids import control_character, new_turn_id, turn_id_from
from ..session.roles import ROLES
from ..session.turn import TurnRequest


# Conversation ids known clients send without being asked: Codex (``session-id``, older
# versions ``session_id`` / ``conversation_id``), Claude Code (``X-Claude-Code-Session-Id``).
CLIENT_SESSION_HEADERS = ("session-id", "session_id", "conversation_id", "conversation-id", "x-claude-code-session-id")
_CLAUDE_USER_SESSION = re.compile(r"_session_([0-9a-fA-F-]{8,64})$")


def header_map(request) -> dict[str, str]:
    """A request's headers by name (ASGI names are lower-case), the first value of each, decoded
    once: a turn asks for about a dozen, and starlette's ``Headers.get`` scans and decodes the
    whole list for each."""
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in reversed(request.scope["headers"])}


def client_session(headers, metadata: dict[str, Any] | None = None) -> str | None:
    """The conversation id a known client sends on its own, used when no session is named.

    Codex sends its thread id as a ``session-id`` header; Claude Code sends
    ``X-Claude-Code-Session-Id`` and puts the same id in ``metadata.user_id`` (a JSON object
    with ``session_id`` in current versions, ``user_..._session_<uuid>`` in older ones).
    """
    for h in CLIENT_SESSION_HEADERS:
        v = headers.get(h) if headers is not None else None
        if v and len(v) <= 256:
            return v.strip()
    user = (metadata or {}).get("user_id")
    if isinstance(user, str) and user:
        if user.startswith("{"):
            try:
                sid = orjson.loads(user).get("session_id")
            except (orjson.JSONDecodeError, AttributeError):
                sid = None
            if isinstance(sid, str) and 0 < len(sid) <= 256:
                return sid
        m = _CLAUDE_USER_SESSION.search(user)
        if m:
            return m.group(1)
    return None


def conversation_of(headers) -> str | None:
    """The conversation a request names by header (``X-Session-Id``, else a known client's own
    id): what per-conversation caches (``history_memo``) are keyed by."""
    return headers.get("x-session-id") or client_session(headers)


def session_fields(headers, metadata: dict[str, Any] | None, fallback: str | None = None) -> tuple[str | None, str | None, int | None]:
    """``(session_id, group_id, group_size)`` from ``X-Session-Id`` / ``X-Group-Id`` /
    ``X-Group-Size`` headers, else ``metadata.session_id`` / ``group_id`` / ``group_size``;
    the session falls back to ``fallback`` (a known client's own conversation id)."""
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
        if not 1 <= size <= 1_000_000:  # stored as an SQLite integer; no real group is larger
            raise bad_request(f"group size must be a positive integer, got {gsize!r}", code="invalid_value", param="group_size")
    for name, v in (("session_id", sid), ("group_id", gid)):
        if v is not None and not isinstance(v, (str, int)):
            raise bad_request(f"{name} must be a string", code="invalid_value", param=name)
        if v is not None and len(str(v)) > 256:
            raise bad_request(f"{name} is longer than 256 characters", code="invalid_value", param=name)
    if sid in (None, "") and fallback:
        sid = fallback
    for name, v in (("session_id", sid), ("group_id", gid)):
        check_id(name, v)
    return (str(sid) if sid not in (None, "") else None, str(gid) if gid not in (None, "") else None, size)


def check_id(name: str, value: Any) -> None:
    """400 for an id holding a control character (a NUL, a newline, ...): it could never be
    sent back in a header, read in a log or typed into a URL."""
    if isinstance(value, str) and (bad := control_character(value)) is not None:
        raise bad_request(f"{name} contains the control character {bad}; ids must be printable text", code="invalid_value", param=name)


def parent_hint(candidates: list[str]) -> str | None:
    """The turn id of the most recent Splice-issued id among ``candidates`` (oldest first)."""
    for cand in reversed(candidates):
        tid = turn_id_from(cand)
        if tid is not None:
            return tid
    return None


def turn_request(api, req, headers, *, model: str, messages, tools, hints: list[str], stop: list[str], max_output_tokens: int | None,
                 present=None, not_offered: list[str] | None = None, controls: dict[str, Any] | None = None,
                 metadata: dict[str, Any] | None = None) -> TurnRequest:  # fmt: skip
    """The session layer's request, from any front end's validated body.

    The turn id is chosen up front so streamed item ids are final from the first event.
    ``controls`` are what the request set that Splice records but does not enforce.
    """
    meta = req.metadata if metadata is None else metadata
    session_id, group_id, group_size = session_fields(headers, meta, client_session(headers, meta))
    policy = headers.get("x-splice-history-edits") if headers is not None else None
    if policy is not None:
        policy = policy.strip().lower()
        if policy not in ("fork", "keep"):
            raise bad_request(f"X-Splice-History-Edits must be 'fork' or 'keep', got {policy!r}", code="invalid_value", param="X-Splice-History-Edits")
    role = headers.get("x-splice-role") if headers is not None else None
    if role is not None:
        role = role.strip().lower()
        if role not in ROLES:
            raise bad_request(f"X-Splice-Role must be one of {', '.join(ROLES)}, got {role!r}", code="invalid_value", param="X-Splice-Role")
    return TurnRequest(
        api=api,
        messages=messages,
        tools=tools,
        model=req.model or model,
        session_id=session_id,
        group_id=group_id,
        group_size=group_size,
        parent_hint=parent_hint(hints),
        max_output_tokens=max_output_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        stop=stop,
        chat_template_kwargs=req.chat_template_kwargs,
        metadata=dict(meta or {}),
        turn_id=new_turn_id(),
        present=present,
        tools_not_offered=list(not_offered or ()),
        controls_not_enforced={k: v for k, v in (controls or {}).items() if v is not None},
        history_edits_policy=policy,
        role=role or None,
    )


@dataclass
class DialectContext:
    """What every dialect keeps about one request while its turn runs: the session layer's
    request and the chat format its output is decoded with. Dialects add their own fields."""

    turn: TurnRequest
    fmt: ChatFormat

    @property
    def turn_id(self) -> str:
        return self.turn.turn_id

    @property
    def model(self) -> str:
        return self.turn.model
