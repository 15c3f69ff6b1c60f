"""Bearer-token checks, compared in constant time: who may call which route.

Three credentials, each optional:

- the agent API key (``--api-key``): the routes agents call (Responses, Chat, Messages, models);
- the admin token (``--admin-token``): the trainer's routes: pulls and acks, stored images
  (``/v1/images/*``), ``/admin/*``, and the session routes (listing, reading, rewards);
- the reward token (``--reward-token``): a grader's credential: rewards and session
  listing / reading, nothing else.

The session viewer's page and assets (``/ui``, ``/ui/static/*``) hold no data and are open;
its data (``/ui/api/*``) needs the session-reading credential, like ``/v1/sessions``.

The agent key never opens a trainer route once an admin or reward token is set: an agent with
shell tools (Codex, Claude Code) holds the agent key and could otherwise read every session
and reward itself. With neither set, the session routes fall back to the agent key (and the
proxy refuses to bind a public address without an admin token).
"""

from __future__ import annotations

import hmac
from enum import Enum

from .errors import APIError

OPEN_PATHS = ("/health", "/metrics")


class Access(Enum):
    OPEN = "open"
    AGENT = "agent"  # the API key
    SESSIONS = "sessions"  # session listing / reading / rewards: admin or reward token
    TRAINER = "trainer"  # pulls, acks, /admin: the admin token


def access_of(path: str) -> Access:
    """Which credential a path needs."""
    if path in OPEN_PATHS:
        return Access.OPEN
    if path.startswith("/ui/api/"):
        return Access.SESSIONS
    if path in ("/ui", "/ui/") or path.startswith("/ui/static/"):
        return Access.OPEN  # the viewer's shell: no data
    if path.startswith(("/admin/", "/v1/trajectories/", "/v1/images/")) or path == "/admin":
        return Access.TRAINER
    if path == "/v1/sessions" or path.startswith("/v1/sessions/"):
        return Access.SESSIONS
    return Access.AGENT


def bearer(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def _matches(offered: list[str | None], tokens: list[str]) -> bool:
    return any(
        got is not None and hmac.compare_digest(got.encode(), need.encode()) for got in offered for need in tokens
    )


def check(
    path: str,
    authorization: str | None,
    *,
    api_key: str | None,
    admin_token: str | None,
    x_api_key: str | None = None,
    reward_token: str | None = None,
) -> None:
    """Raise 401 unless the request carries the token its route needs.

    Agent routes take the API key as ``Authorization: Bearer`` (OpenAI's SDKs) or ``x-api-key``
    (Anthropic's); the trainer's and the session routes only a bearer token.
    """
    access = access_of(path)
    if access is Access.OPEN:
        return
    if access is Access.AGENT:
        if api_key is None or _matches([bearer(authorization), x_api_key], [api_key]):
            return
        raise APIError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'.", code="invalid_api_key")
    if access is Access.TRAINER:
        if admin_token is None or _matches([bearer(authorization)], [admin_token]):
            return
        raise APIError(401, "Invalid or missing admin token: send 'Authorization: Bearer <admin token>'.", code="invalid_api_key")
    trainer = [t for t in (admin_token, reward_token) if t is not None]
    if not trainer:  # no trainer credential configured: the agent key (if any) guards sessions
        if api_key is None or _matches([bearer(authorization), x_api_key], [api_key]):
            return
        raise APIError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'.", code="invalid_api_key")
    if _matches([bearer(authorization)], trainer):
        return
    names = " or ".join(n for n, t in (("admin token", admin_token), ("reward token", reward_token)) if t is not None)
    raise APIError(
        401,
        f"Session listing, reading and rewards need the {names} ('Authorization: Bearer <token>'); "
        "the agents' API key is not accepted here.",
        code="invalid_api_key",
    )
