"""Bearer-token checks, compared in constant time."""

from __future__ import annotations

import hmac

from .errors import APIError

ADMIN_PREFIXES = ("/admin/", "/v1/trajectories/")
OPEN_PATHS = ("/health", "/metrics")


def bearer(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def check(path: str, authorization: str | None, *, api_key: str | None, admin_token: str | None) -> None:
    """Raise 401 unless the request carries the token its route needs."""
    if path in OPEN_PATHS:
        return
    need = admin_token if path.startswith(ADMIN_PREFIXES) else api_key
    if need is None:
        return
    got = bearer(authorization)
    if got is None or not hmac.compare_digest(got.encode(), need.encode()):
        kind = "admin token" if path.startswith(ADMIN_PREFIXES) else "API key"
        raise APIError(401, f"Invalid or missing {kind}: send 'Authorization: Bearer <token>'.", code="invalid_api_key")
