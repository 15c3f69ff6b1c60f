"""The HTTP server's own limits, below the app: how large a request's headers may be and how
long a client may take to send them.

uvicorn's httptools protocol has neither (an 8 MB header block is accepted, and a socket that
sends a byte every few seconds is held open forever). ``LimitedHttpToolsProtocol`` adds both:

- headers (request line included) above ``max_header_bytes``: 431 in OpenAI's error shape,
  then a lingering close (the rest of what the client sends is read and dropped, bounded, so
  it reads the answer instead of a connection reset);
- headers not complete ``header_timeout_s`` after the connection opened or the request began:
  408, and the connection is closed;
- a request the HTTP parser rejects (a NUL or other control character in a header, a broken
  request line): 400 in OpenAI's error shape instead of uvicorn's plain-text one.

It also sends a response's head and body in one write (``OneSend``): uvicorn writes the status
line and headers as soon as the app starts its response, so every JSON answer took two system
calls and two TCP segments, and woke the client twice. And it keeps a request body as the pieces
the parser gave (``BodyPieces``): uvicorn appended each to a bytearray and copied that into
``bytes`` for the app, two copies of a 400 KB body at 100k tokens of history. It stops reading
a body only past ``BODY_HIGH_WATER`` buffered (uvicorn: 64 KB), so a long session's request
comes in without a pause and resume per turn. And it tells the app when a client goes away
before its answer is complete (``Disconnect``, in ``scope["extensions"]``), so a turn learns of
it from a callback instead of a task parked on ``receive()`` for the whole turn.

Without httptools, uvicorn's h11 protocol is used with its header size limit.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import orjson

# Request body bytes a connection buffers before it stops reading until the app takes them.
# uvicorn's 64 KB paused and resumed every turn past ~16k tokens of history (two epoll changes,
# a second ``receive``); the guard reads a turn's whole body anyway, up to ``max_request_bytes``.
BODY_HIGH_WATER = 4 << 20
LINGER_S = 5.0  # how long a refused connection is read and dropped before it is closed
LINGER_MAX_BYTES = 64 << 20


# scope["extensions"] key of a request's ``Disconnect`` (absent under other servers: the app
# then watches ``receive()`` for ``http.disconnect``).
DISCONNECT = "splice.disconnect"


class _HeadersTooLarge(Exception):
    pass


class Disconnect:
    """Callbacks run once when the client goes away before the request's response is complete."""

    __slots__ = ("_callbacks", "gone")

    def __init__(self) -> None:
        self._callbacks: list[Callable[[], None]] = []
        self.gone = False

    def add(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Run ``callback`` on disconnect (at once if the client is gone already); returns the
        function that removes it."""
        if self.gone:
            callback()
            return lambda: None
        self._callbacks.append(callback)
        return lambda: self._callbacks.remove(callback) if callback in self._callbacks else None

    def fire(self) -> None:
        self.gone = True
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()


class OneSend:
    """A response's transport that holds its head until the first write after it: a JSON answer
    (head, then body, in the same step of the app) goes out in one write. A head with nothing
    after it (a stream whose first event is not ready) is written when the loop next runs."""

    __slots__ = ("_transport", "_loop", "_head")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self._transport = transport
        self._loop = loop
        self._head: bytes | None = None

    def write(self, data: bytes) -> None:
        head = self._head
        if head is not None:
            self._head = None
            self._transport.write(head + data)
        elif data.startswith(b"HTTP/1.1 "):  # the status line and headers (uvicorn writes them in one piece)
            self._head = data
            self._loop.call_soon(self.flush)
        else:
            self._transport.write(data)

    def flush(self) -> None:
        head = self._head
        if head is not None:
            self._head = None
            if not self._transport.is_closing():
                self._transport.write(head)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()


class BodyPieces:
    """What uvicorn's request cycle keeps as ``body`` between two ``receive`` calls: the parser's
    own ``bytes`` pieces, not a bytearray they are copied into. uvicorn uses only ``+=``,
    ``len()`` and ``bytes()`` on it; ``bytes()`` of a single piece is that piece, uncopied."""

    __slots__ = ("_pieces", "_size")

    def __init__(self, first: bytes | bytearray = b""):
        self._pieces: list[bytes] = [bytes(first)] if first else []
        self._size = len(first)

    def __iadd__(self, piece: bytes) -> "BodyPieces":
        self._pieces.append(piece)
        self._size += len(piece)
        return self

    def __len__(self) -> int:
        return self._size

    def __bytes__(self) -> bytes:
        pieces = self._pieces
        if len(pieces) == 1 and type(pieces[0]) is bytes:
            return pieces[0]
        return b"".join(pieces)


def _response(status: int, reason: bytes, message: str, code: str) -> bytes:
    body = orjson.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}})
    head = b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % (status, reason, len(body))
    return head + body


def limited_protocol(max_header_bytes: int, header_timeout_s: float) -> type[asyncio.Protocol] | None:
    """A protocol class enforcing the two limits; None when httptools is not installed."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # pragma: no cover - httptools is a dependency
        return None

    class LimitedHttpToolsProtocol(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._header_bytes = 0
            self._too_large = False
            self._refusing = False
            self._dropped = 0
            self._header_timer: asyncio.TimerHandle | None = None
            self._header_deadline: float | None = None  # loop time by which the headers must be complete
            self._linger_timer: asyncio.TimerHandle | None = None

        # -- header read time ------------------------------------------------------------
        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        # One timer per connection at most, not one made and cancelled per request (a keep-alive
        # connection carries thousands): a request sets its deadline, complete headers clear it,
        # and the timer, when it fires, either finds no deadline, waits out the one now set, or
        # answers 408.
        def _arm(self) -> None:
            if self._header_deadline is None:
                self._header_deadline = self.loop.time() + header_timeout_s
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout_s, self._header_timeout)

        def _disarm(self) -> None:
            self._header_deadline = None

        def _cancel_timer(self) -> None:
            self._header_deadline = None
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timeout(self) -> None:
            self._header_timer = None
            if self._header_deadline is None:
                return  # the headers came in time; the next request arms again
            left = self._header_deadline - self.loop.time()
            if left > 0:
                self._header_timer = self.loop.call_later(left, self._header_timeout)
                return
            if self._refusing or self.transport.is_closing():
                return
            self.transport.write(_response(408, b"Request Timeout", f"request headers not received within {header_timeout_s:g} s", "request_timeout"))
            self.transport.close()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._header_bytes = 0
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            before = self.cycle
            super().on_headers_complete()
            if self.cycle is not before:  # a request to answer (not an upgrade): its task has not run yet
                self.cycle.transport = OneSend(self.transport, self.loop)
                self.cycle.scope.setdefault("extensions", {})[DISCONNECT] = Disconnect()

        def on_body(self, body: bytes) -> None:  # uvicorn's, with BodyPieces and BODY_HIGH_WATER
            cycle = self.cycle
            if (self.parser.should_upgrade() and self._should_upgrade()) or cycle.response_complete:
                return
            if type(cycle.body) is not BodyPieces:  # a fresh cycle, or one ``receive`` just emptied
                cycle.body = BodyPieces(cycle.body)
            cycle.body += body
            if len(cycle.body) > BODY_HIGH_WATER:
                self.flow.pause_reading()
            cycle.message_event.set()

        def connection_lost(self, exc) -> None:
            self._cancel_timer()
            if self._linger_timer is not None:
                self._linger_timer.cancel()
                self._linger_timer = None
            cycle = self.cycle
            super().connection_lost(exc)
            if cycle is not None and cycle.disconnected:  # gone before its response was complete
                hook = cycle.scope.get("extensions", {}).get(DISCONNECT)
                if hook is not None:
                    hook.fire()

        # -- header size -----------------------------------------------------------------
        def _count(self, n: int) -> None:
            self._header_bytes += n
            if self._header_bytes > max_header_bytes:
                self._too_large = True
                raise _HeadersTooLarge()  # httptools stops parsing; uvicorn calls send_400_response

        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value) + 4)
            super().on_header(name, value)

        def send_400_response(self, msg: str) -> None:
            self._disarm()
            if not self._too_large:  # a request the parser rejects (a control character in a header, ...)
                self.transport.write(_response(400, b"Bad Request", "malformed HTTP request: the request line or a header is invalid", "invalid_request"))
                self._linger()
                return
            self.transport.write(_response(431, b"Request Header Fields Too Large", f"request headers are larger than {max_header_bytes} bytes", "request_header_fields_too_large"))
            self._linger()

        def _linger(self) -> None:
            """Answer sent: stop writing, read and drop what the client still sends, then close."""
            self._refusing = True
            self.flow.resume_reading()
            if self.transport.can_write_eof():
                self.transport.write_eof()
                self._linger_timer = self.loop.call_later(LINGER_S, self.transport.close)
            else:
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self._refusing:
                self._dropped += len(data)
                if self._dropped > LINGER_MAX_BYTES:
                    self.transport.close()
                return
            super().data_received(data)

        def eof_received(self) -> bool | None:
            if self._refusing:
                self.transport.close()
                return None
            return super().eof_received()

    return LimitedHttpToolsProtocol


def server_options(max_header_bytes: int, header_timeout_s: float, keepalive_s: float) -> dict[str, Any]:
    """``uvicorn.Config`` keyword arguments that apply the limits and the idle keep-alive.

    ``proxy_headers`` off: nothing in Splice reads the client's address (access is by token,
    the access log is off), so uvicorn's ``X-Forwarded-*`` rewriting would be a layer of work per
    request for nothing."""
    common = {"timeout_keep_alive": keepalive_s, "proxy_headers": False}
    proto = limited_protocol(max_header_bytes, header_timeout_s)
    if proto is not None:
        return {"http": proto, **common}
    return {"http": "h11", "h11_max_incomplete_event_size": max_header_bytes, **common}
