"""Errors in OpenAI's shape: ``{"error": {"message", "type", "code", "param"}}`` with the right status."""

from __future__ import annotations

import re
from typing import Any

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    499: "invalid_request_error",
    500: "server_error",
    502: "server_error",
    503: "server_error",
    504: "server_error",
}


class APIError(Exception):
    """Raise anywhere in the proxy; the app turns it into an OpenAI-shaped JSON error."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, code=self.code, param=self.param)


def error_body(status: int, message: str, *, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param, "code": code}}


def bad_request(message: str, *, code: str | None = "invalid_request", param: str | None = None) -> APIError:
    return APIError(400, message, code=code, param=param)


def not_found(message: str, *, code: str = "not_found") -> APIError:
    return APIError(404, message, code=code)


_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^/@:\s]*):[^/@\s]*@")


def redact(text: str) -> str:
    """``text`` with the password of every ``scheme://user:password@host`` replaced by ``***``.

    A backstop for messages that reach clients or logs: engine URLs are redacted where they are
    formatted (``engines.http.redact_url``); this catches any that an exception carries."""
    return _USERINFO.sub(r"\g<scheme>\g<user>:***@", text) if "@" in text else text


def from_engine_error(exc) -> APIError:
    """An ``engines.types.EngineError`` as the API error agents and admins see (one mapping)."""
    headers = {"Retry-After": "1"} if exc.status_code in (429, 502, 503, 504) else None
    return APIError(exc.status_code, redact(f"inference engine error: {exc}"), code=exc.code, headers=headers)


def internal_error(exc: BaseException) -> APIError:
    """Anything unexpected, as a 500 in the API's shape (no traceback, no secrets)."""
    return APIError(500, redact(f"internal error: {type(exc).__name__}: {exc}")[:500], code="internal_error")
