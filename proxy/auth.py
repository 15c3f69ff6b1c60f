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


def check(path: str, authorization: str | None, *, api_key: str | None, admin_token: str | None, x_api_key: str | None = None) -> None:
    """Raise 401 unless the request carries the token its route needs.

    Agent routes take the API key as ``Authorization: Bearer`` (OpenAI's SDKs) or ``x-api-key``
    (Anthropic's); admin routes only as a bearer token.
    """
    if path in OPEN_PATHS:
        return
    admin = path.startswith(ADMIN_PREFIXES)
    need = admin_token if admin else api_key
    if need is None:
        return
    offered = [bearer(authorization)] + ([] if admin else [x_api_key])
    if not any(got is not None and hmac.compare_digest(got.encode(), need.encode()) for got in offered):
        how = "'Authorization: Bearer <token>'" if admin else "'Authorization: Bearer <key>' or 'x-api-key: <key>'"
        raise APIError(401, f"Invalid or missing {'admin token' if admin else 'API key'}: send {how}.", code="invalid_api_key")
