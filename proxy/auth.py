"""Bearer-token checks, compared in constant time: who may call which route.

Three credentials, each optional:

- the agent API key (``--api-key``): the routes agents call (Responses, Chat, Messages, models);
- the admin token (``--admin-token``): the trainer's routes: pulls and acks, stored images
  (``/v1/images/*``), ``/admin/*``, and the session routes (listing, reading, rewards);
- the reward token (``--reward-token``): a grader's credential: rewards and session
  listing / reading, nothing else.

The agent key never opens a trainer route: an agent with shell tools (Codex, Claude Code) holds
the agent key and could otherwise read every session, reward itself, lease samples away or move
the policy version. ``splice serve`` always has an admin token: the one given, or one it
generates into ``admin_token_file()`` (0600), where ``splice train`` / ``publish`` / ``export``
on the same machine find it. A bare ``create_app`` (tests, embedding) with no credential at all
leaves every route open; with only an agent key the trainer routes are closed to everyone.

The session viewer's page and assets (``/ui``, ``/ui/static/*``) hold no data and are open;
its data (``/ui/api/*``) needs the session-reading credential, like ``/v1/sessions``.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
import stat
from enum import Enum
from pathlib import Path

from .errors import APIError

OPEN_PATHS = ("/health", "/metrics")
ADMIN_TOKEN_FILE = "admin_token"


class Access(Enum):
    OPEN = "open"
    AGENT = "agent"  # the API key
    SESSIONS = "sessions"  # session listing / reading / rewards: admin or reward token
    TRAINER = "trainer"  # pulls, acks, /admin: the admin token


def access_of(path: str, *, metrics_open: bool = True) -> Access:
    """Which credential a path needs (``/metrics`` takes the admin token unless ``metrics_open``)."""
    if path == "/metrics" and not metrics_open:
        return Access.TRAINER
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
    metrics_open: bool = True,
) -> None:
    """Raise 401 unless the request carries the token its route needs.

    Agent routes take the API key as ``Authorization: Bearer`` (OpenAI's SDKs) or ``x-api-key``
    (Anthropic's); the trainer's and the session routes only a bearer token. With no credential
    configured at all (a bare app in a test) every route is open; otherwise a trainer route with
    no admin token configured is closed, never opened by the agent key.
    """
    access = access_of(path, metrics_open=metrics_open)
    if access is Access.OPEN:
        return
    unguarded = api_key is None and admin_token is None and reward_token is None
    if access is Access.AGENT:
        if api_key is None or _matches([bearer(authorization), x_api_key], [api_key]):
            return
        raise APIError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'.", code="invalid_api_key")
    if access is Access.TRAINER:
        if unguarded or (admin_token is not None and _matches([bearer(authorization)], [admin_token])):
            return
        raise APIError(401, "Invalid or missing admin token: send 'Authorization: Bearer <admin token>'.", code="invalid_api_key")
    trainer = [t for t in (admin_token, reward_token) if t is not None]
    if unguarded or _matches([bearer(authorization)], trainer):
        return
    names = " or ".join(n for n, t in (("admin token", admin_token), ("reward token", reward_token)) if t is not None) or "admin token"
    raise APIError(
        401,
        f"Session listing, reading and rewards need the {names} ('Authorization: Bearer <token>'); "
        "the agents' API key is not accepted here.",
        code="invalid_api_key",
    )


def local_admin_headers() -> dict[str, str]:
    """``Authorization`` for a ``splice serve`` on this machine started without ``--admin-token``
    (``$SPLICE_ADMIN_TOKEN`` if set, else the token file, created now if missing): benches use it."""
    token = os.environ.get("SPLICE_ADMIN_TOKEN") or load_or_create_admin_token()[0]
    return {"Authorization": f"Bearer {token}"}


def is_loopback_host(host: str) -> bool:
    """A listen address only this machine can reach (``localhost``, 127/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# -- the generated admin token ------------------------------------------------------------------


def splice_home() -> Path:
    """``$SPLICE_HOME`` or ``~/.cache/splice`` (where the bundled model is cached too)."""
    return Path(os.environ.get("SPLICE_HOME") or Path.home() / ".cache" / "splice")


def admin_token_file() -> Path:
    """Where ``splice serve`` keeps the admin token it generates: ``$SPLICE_HOME/admin_token``."""
    return splice_home() / ADMIN_TOKEN_FILE


class TokenFileError(Exception):
    """The token file exists but cannot be trusted or read (its message says why and what to do)."""


def read_token_file(path: Path) -> str | None:
    """The token in ``path``; None if there is none. Refuses a file others may read or write."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise TokenFileError(f"cannot read the admin token file {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TokenFileError(f"the admin token file {path} is not a regular file")
        if st.st_mode & 0o077 or (hasattr(os, "getuid") and st.st_uid != os.getuid()):
            raise TokenFileError(
                f"the admin token file {path} may be read by other users (mode {stat.S_IMODE(st.st_mode):o}); "
                f"run 'chmod 600 {path}' or delete it to have a new one generated"
            )
        token = os.read(fd, 4096).decode("utf-8", "replace").strip()
    finally:
        os.close(fd)
    if not token:
        raise TokenFileError(f"the admin token file {path} is empty; delete it to have a new one generated")
    return token


def load_or_create_admin_token(path: Path | None = None) -> tuple[str, bool]:
    """The token in ``path`` (default ``admin_token_file()``), created (0600, 256 random bits) if
    missing: ``(token, created)``. Safe against another ``splice serve`` creating it at once: the
    file appears complete or not at all (written aside, then hard-linked into place)."""
    path = path or admin_token_file()
    token = read_token_file(path)
    if token is not None:
        return token, False
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    new = secrets.token_urlsafe(32)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.write(fd, (new + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:  # another serve won the race: use its token
            token = read_token_file(path)
            if token is None:  # pragma: no cover - deleted in between
                raise TokenFileError(f"the admin token file {path} vanished while it was being created") from None
            return token, False
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
    return new, True
