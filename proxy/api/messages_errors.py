"""Errors in Anthropic's shape (``{"type": "error", "error": {...}}``) for the ``/v1/messages``
routes: the dialect module, its stream and the app's exception handlers all answer with them."""

from __future__ import annotations

from typing import Any

from ..errors import APIError
from .jsonio import JSONResponse

# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors); a saturated
# proxy answers 529 ``overloaded_error`` as Anthropic does.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}
_STATUS = {503: 529, 502: 500}


def anthropic_error(status: int, message: str) -> tuple[int, dict[str, Any]]:
    """``(status, body)`` of an error in Anthropic's shape."""
    status = _STATUS.get(status, status)
    default = "invalid_request_error" if 400 <= status < 500 else "api_error"  # e.g. 405, 408, 431
    return status, {"type": "error", "error": {"type": _ERROR_TYPES.get(status, default), "message": message}}


def error_response(exc: APIError) -> JSONResponse:
    status, body = anthropic_error(exc.status, exc.message)
    return JSONResponse(body, status_code=status, headers=exc.headers)


def is_messages_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")

