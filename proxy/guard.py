"""Per-request checks and request metrics as a plain ASGI middleware (no per-request task or
body re-streaming, unlike ``BaseHTTPMiddleware``): auth, body size, saturation."""

from __future__ import annotations

import time

import orjson

from . import auth
from .errors import APIError


def route_label(path: str) -> str:
    if path.startswith("/v1/responses"):
        return "responses"
    if path.startswith("/v1/chat/completions"):
        return "chat"
    if path.startswith("/v1/sessions"):
        return "sessions"
    if path.startswith("/v1/trajectories"):
        return "trajectories"
    if path.startswith("/admin"):
        return "admin"
    if path in ("/health", "/metrics", "/v1/models"):
        return path.strip("/").replace("/", "_")
    return "other"


class Guard:
    def __init__(self, app, *, settings, metrics):
        self.app = app
        self.settings = settings
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        route = route_label(path)
        m = self.metrics
        t0 = time.perf_counter()
        try:
            self._check(scope, path, route)
        except APIError as exc:
            m.errors.labels(route, exc.code or str(exc.status)).inc()
            m.requests.labels(route, str(exc.status)).inc()
            return await _send_error(send, exc)
        status = 500

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            m.requests.labels(route, str(status)).inc()
            if status >= 400:
                m.errors.labels(route, str(status)).inc()
            m.request_seconds.labels(route).observe(time.perf_counter() - t0)

    def _check(self, scope, path: str, route: str) -> None:
        s = self.settings
        authorization = None
        length = None
        for k, v in scope["headers"]:
            if k == b"authorization":
                authorization = v.decode("latin-1")
            elif k == b"content-length":
                length = v
        auth.check(path, authorization, api_key=s.api_key, admin_token=s.admin_token)
        if length is not None and length.isdigit() and int(length) > s.max_request_bytes:
            raise APIError(413, f"request body is larger than {s.max_request_bytes} bytes", code="request_too_large")
        if route in ("responses", "chat") and scope["method"] == "POST" and self.metrics.inflight._value.get() >= s.max_inflight:
            raise APIError(429, "too many turns in flight; retry shortly", code="saturated", headers={"Retry-After": "1"})


async def _send_error(send, exc: APIError) -> None:
    body = orjson.dumps(exc.body())
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in exc.headers.items()]
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
