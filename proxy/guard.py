"""Per-request checks and request metrics as a plain ASGI middleware (no per-request task or
body re-streaming, unlike ``BaseHTTPMiddleware``): auth, body size, admission, and the last
line of defence against anything unexpected.

- Body size: ``Content-Length`` above ``max_request_bytes`` is refused up front (413), and the
  bytes actually read are counted too, so a chunked upload without a length cannot exceed it.
  The rest of an oversized upload is read and discarded (bounded) before the 413 goes out, so
  the client reads the 413 instead of a connection reset.
- Body time: the whole body must arrive within ``body_timeout_s`` of the request reaching the
  app (after its headers); else 408 and the connection is closed. A client that goes away
  mid-body is an INFO line, not an error.
- Admission: at most ``max_inflight`` turns (agent POSTs) run at once; a request beyond that
  waits up to ``admission_wait_s`` for a slot (FIFO), then gets 429 with ``Retry-After``. A turn's
  body is read (under the deadline) *before* it asks for a slot, so sockets that send headers and
  a slow or missing body hold no slot and cannot starve real turns. Visible in ``/metrics``
  (``splice_admission_*``).
- Turns go straight to their endpoint (``direct``: path -> ``async (Request) -> Response``), past
  the framework's own layers (the guard runs in front of FastAPI: ``proxy.app.SpliceApp``):
  those cost about as much CPU per turn as splicing does, and a turn route has no dependencies,
  path parameters or handlers the guard does not already apply (its errors are the guard's
  ``APIError`` answers).
- An exception that escapes the app becomes a 500 in the API's error shape (when the response
  has not started) and never reaches the server, which would reset the keep-alive connection.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

import orjson
from starlette.requests import ClientDisconnect, Request

from . import auth
from .errors import APIError, internal_error

log = logging.getLogger("splice.guard")

TURN_ROUTES = ("responses", "chat", "messages")


def route_label(path: str) -> str:
    if path.startswith("/v1/responses"):
        return "responses"
    if path.startswith("/v1/chat/completions"):
        return "chat"
    if path.startswith("/v1/messages"):
        return "messages"
    if path.startswith("/v1/sessions"):
        return "sessions"
    if path.startswith("/v1/trajectories"):
        return "trajectories"
    if path.startswith("/admin"):
        return "admin"
    if path in ("/health", "/metrics", "/v1/models"):
        return path.strip("/").replace("/", "_")
    return "other"


class Admission:
    """A FIFO counting gate with a bounded wait: ``acquire()`` is True once admitted."""

    def __init__(self, limit: int, wait_s: float, metrics=None):
        self.limit = max(1, int(limit))
        self.wait_s = max(0.0, float(wait_s))
        self.active = 0
        self._waiters: deque[asyncio.Future] = deque()
        if metrics is not None:  # read when /metrics is scraped, not set on every request
            metrics.admission_active.set_function(lambda: self.active)
            metrics.admission_waiting.set_function(lambda: len(self._waiters))

    async def acquire(self) -> bool:
        if self.active < self.limit and not self._waiters:
            self.active += 1
            return True
        if self.wait_s <= 0:
            return False
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:  # not wait_for: in Python 3.11 it drops a cancel that lands as the slot is handed over
            await _within(fut, self.wait_s)
            return True  # the releasing request handed its slot over
        except TimeoutError:
            return fut.done() and not fut.cancelled()  # handed over as the wait ran out: keep it
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # admitted and gone at once: pass the slot on
            raise
        finally:
            try:
                self._waiters.remove(fut)
            except ValueError:
                pass

    def release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot moves to the oldest waiter; active is unchanged
                return
        self.active -= 1


class BodyTooLarge(APIError):
    pass


class BodyTimeout(APIError):
    pass


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


async def _within(awaitable, seconds: float):
    async with asyncio.timeout(seconds):  # no task per receive, unlike ``wait_for``
        return await awaitable


async def _read_body(receive) -> bytes:
    """The whole request body through ``receive`` (the guarded one: size, deadline, disconnect)."""
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


class _ReadRequest(Request):
    """A turn's request whose body the guard has read: ``body()`` hands it over as it is
    (Starlette's own would join it with an empty last chunk, a copy of 400 KB at 100k tokens)."""

    def __init__(self, scope, receive, body: bytes):
        super().__init__(scope, receive)
        self._read = body

    async def body(self) -> bytes:
        return self._read


def _replay(body: bytes, receive):
    """``receive`` that hands the app the body already read, then waits on the client (disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


class Guard:
    def __init__(self, app, *, settings, metrics, direct: dict | None = None):
        self.app = app
        self.direct = dict(direct or {})
        self.settings = settings
        self.metrics = metrics
        self.admission = Admission(settings.max_inflight, settings.admission_wait_s, metrics)
        # /metrics is open on loopback (a local Prometheus); beyond it, it takes the admin token
        self.metrics_open = auth.is_loopback_host(settings.host)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        route = route_label(path)
        m = self.metrics
        t0 = time.perf_counter()
        try:
            self._check(scope, path)
        except APIError as exc:
            if isinstance(exc, BodyTooLarge):
                await _discard_body(receive)  # so the client, still uploading, reads the 413
            return await self._refuse(send, route, exc)
        receive = self._limited(receive)
        admitted = False
        body = None
        if route in TURN_ROUTES and scope["method"] == "POST":
            try:  # the body first, under its deadline: only then does the turn take a slot
                body = await _read_body(receive)
            except ClientGone:
                self._client_gone(scope)
                m.requests.labels(route, "499").inc()
                return
            except APIError as exc:
                return await self._refuse(send, route, exc)
            receive = _replay(body, receive)
            admitted = await self.admission.acquire()
            if not admitted:
                m.admission_rejected.inc()
                exc = APIError(
                    429, f"Splice is at its limit of {self.admission.limit} turns in flight; retry shortly",
                    code="saturated", headers={"Retry-After": self._retry_after()},
                )  # fmt: skip
                return await self._refuse(send, route, exc)
        status = 500
        started = False

        async def send_status(message):
            nonlocal status, started
            if message["type"] == "http.response.start":
                status = message["status"]
                started = True
            await send(message)

        endpoint = self.direct.get(path) if scope["method"] == "POST" else None
        try:
            if endpoint is not None:
                response = await endpoint(Request(scope, receive) if body is None else _ReadRequest(scope, receive, body))
                await response(scope, receive, send_status)
            else:
                await self.app(scope, receive, send_status)
        except (ClientGone, ClientDisconnect):
            status = 499  # nginx's "client closed request": nobody is there to answer
            self._client_gone(scope)
        except Exception as exc:  # noqa: BLE001 - the last line: never let the server see it
            if not isinstance(exc, APIError) and endpoint is not None:  # the app's own handler logged the others
                log.exception("unhandled error on %s %s", scope["method"], path)
            if not started:
                await _send_error(send_status, exc if isinstance(exc, APIError) else internal_error(exc), anthropic=route == "messages")
        finally:
            if admitted:
                self.admission.release()
            m.requests.labels(route, str(status)).inc()
            if status >= 400:
                m.errors.labels(route, str(status)).inc()
            m.request_seconds.labels(route).observe(time.perf_counter() - t0)

    @staticmethod
    def _client_gone(scope) -> None:
        log.info("client went away before its request body was complete: %s %s", scope["method"], scope["path"])

    def _retry_after(self) -> str:
        return str(max(1, round(self.admission.wait_s or 1)))

    async def _refuse(self, send, route: str, exc: APIError) -> None:
        m = self.metrics
        m.errors.labels(route, exc.code or str(exc.status)).inc()
        m.requests.labels(route, str(exc.status)).inc()
        await _send_error(send, exc, anthropic=route == "messages")

    def _limited(self, receive):
        """``receive`` that counts body bytes and raises 413 past the limit (chunked uploads),
        408 when the body is not complete within ``body_timeout_s``, and ``ClientGone`` when the
        client leaves mid-body. Once the body is complete it is the plain ``receive`` (apps wait
        on it for a disconnect, with no deadline)."""
        limit = self.settings.max_request_bytes
        timeout_s = self.settings.body_timeout_s
        deadline = time.monotonic() + timeout_s
        seen = 0
        done = False

        async def receive_limited():
            nonlocal seen, done
            if done:
                return await receive()
            try:
                message = await _within(receive(), max(0.0, deadline - time.monotonic()))
            except (asyncio.TimeoutError, TimeoutError):
                raise BodyTimeout(
                    408, f"request body not received within {timeout_s:g} s", code="request_timeout",
                    headers={"Connection": "close"},
                ) from None  # fmt: skip
            if message["type"] == "http.disconnect":
                raise ClientGone()
            if message["type"] == "http.request":
                done = not message.get("more_body", False)
                seen += len(message.get("body", b""))
                if seen > limit:
                    if message.get("more_body", False):
                        await _discard_body(receive)  # whoever answers the 413, the client reads it
                    raise BodyTooLarge(
                        413, f"request body is larger than {limit} bytes", code="request_too_large",
                        headers={"Connection": "close"},  # stop reading the rest of the upload
                    )  # fmt: skip
            return message

        return receive_limited

    def _check(self, scope, path: str) -> None:
        s = self.settings
        authorization = None
        x_api_key = None
        length = None
        for k, v in scope["headers"]:
            if k == b"authorization":
                authorization = v.decode("latin-1")
            elif k == b"x-api-key":
                x_api_key = v.decode("latin-1")
            elif k == b"content-length":
                length = v
        auth.check(path, authorization, api_key=s.api_key, admin_token=s.admin_token, x_api_key=x_api_key, reward_token=s.reward_token,
                   metrics_open=self.metrics_open)
        if length is not None and (not length.isdigit() or int(length) > s.max_request_bytes):
            if not length.isdigit():
                raise APIError(400, "invalid Content-Length header", code="invalid_request")
            raise BodyTooLarge(
                413, f"request body is larger than {s.max_request_bytes} bytes", code="request_too_large",
                headers={"Connection": "close"},
            )  # fmt: skip


# An oversized upload is read and thrown away (up to these bounds) before the 413 is sent: a
# server that answers and closes while the client is still sending makes the client's kernel
# see a reset, and the client never reads the answer.
DISCARD_MAX_BYTES = 1 << 30
DISCARD_MAX_S = 30.0


async def _discard_body(receive) -> None:
    """Read the rest of the request body and drop it, within ``DISCARD_MAX_*``."""
    seen = 0
    deadline = time.monotonic() + DISCARD_MAX_S
    try:
        while seen <= DISCARD_MAX_BYTES:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            message = await _within(receive(), left)
            if message["type"] != "http.request":
                return  # the client went away
            seen += len(message.get("body", b""))
            if not message.get("more_body", False):
                return
    except (asyncio.TimeoutError, OSError):
        return


async def _send_error(send, exc: APIError, *, anthropic: bool = False) -> None:
    status, payload = exc.status, exc.body()
    if anthropic:  # the Messages API's routes answer in Anthropic's error shape
        from .api.messages_errors import anthropic_error

        status, payload = anthropic_error(exc.status, exc.message)
    body = orjson.dumps(payload)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in exc.headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
