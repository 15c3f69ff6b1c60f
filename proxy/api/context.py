"""From a validated request to the session layer's ``TurnRequest``: session and group fields
(headers first, then ``metadata``), the Splice id that names the previous turn, the turn id."""

from __future__ import annotations

from typing import Any

from ..errors import bad_request
from ..ids import new_turn_id, turn_id_from
from ..session.turn import TurnRequest


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


def turn_request(api, req, headers, *, model: str, messages, tools, hints: list[str], stop: list[str], max_output_tokens: int | None, present=None) -> TurnRequest:
    """The session layer's request, from either front end's validated body.

    The turn id is chosen up front so streamed item ids are final from the first event.
    """
    session_id, group_id, group_size = session_fields(headers, req.metadata)
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
        metadata=dict(req.metadata or {}),
        turn_id=new_turn_id(),
        present=present,
    )
