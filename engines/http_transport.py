"""The engine client's wire: keep-alive HTTP/1.1 on asyncio, replies parsed by ``httptools``.

An engine call is one small JSON POST to a server on the same network, answered by one JSON body
or a stream of SSE lines. A general client pays for what such a call never needs: httpx's
transport (httpcore on anyio, h11 in pure Python) cost about 1.6 ms of CPU per ``/generate`` on
a small machine, aiohttp's about 0.3 ms (its request and response objects, cookie jar, URL
objects, tracing hooks and payload writers: a tenth of the proxy's CPU per turn). This module is
what is left: a pool of connections per host, the request written as one buffer, and the reply
parsed by ``httptools`` (llhttp, the parser uvicorn serves with). What it does not do, engines do
not need: redirects, cookies, proxies from the environment, compression, HTTP/2.

``open`` is the direct path every engine call takes (``engines.http.Http``).
``handle_async_request`` keeps it an httpx transport: it is where ``respx`` intercepts in
wire-format tests (tests/conftest.py routes ``open`` through it) and what a plain httpx call on
the engine client sends with. Errors are the httpx exceptions httpcore would raise, so
``map_transport_error`` sorts them the same way: a refused or failed connect is ``ConnectError``,
a server that hangs up is ``RemoteProtocolError``, a timeout is a ``TimeoutException``.
"""

from __future__ import annotations

import asyncio
import ssl
import urllib.parse
from typing import AsyncIterator, NamedTuple

import httptools
import httpx

from engines.json_body import Content, content_length

KEEPALIVE_S = 4.0
"""How long an idle engine connection is reused. Below the engines' own keep-alive (vLLM's
``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` and SGLang's uvicorn both close idle connections after 5 s): a
request written on a connection the server is closing dies with "Server disconnected", and POSTs
are not retried. A 15 s keep-alive lost a ``/pause`` that way after a 6 s quiet spell."""

_READ_AHEAD = 1 << 20  # stop reading from the socket while this much body waits for its reader
_NO_BODY = frozenset((204, 304))


class _Target(NamedTuple):
    """Where a URL's request goes: the pool key, and the request line's and Host header's parts."""

    key: tuple[str, str, int]  # scheme, host, port
    target: bytes  # path and query, as sent on the request line
    host_header: bytes


def _target(url: str) -> _Target:
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise httpx.UnsupportedProtocol(f"invalid URL {url!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise httpx.UnsupportedProtocol(f"engine URLs are http:// or https:// with a host, not {url!r}")
    port = port or (443 if parts.scheme == "https" else 80)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    hostport = parts.netloc.rpartition("@")[2]
    return _Target((parts.scheme, parts.hostname, port), path.encode("ascii"), hostport.encode("idna"))


def _check_header(name: str, value: str) -> None:
    if "\r" in name or "\n" in name or "\r" in value or "\n" in value or ":" in name:
        raise httpx.LocalProtocolError(f"invalid header {name!r}: line breaks (or a colon in its name) are not allowed")


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection: at most one request in flight, its reply's events (headers, body
    pieces, end) waited for with a per-wait read timeout."""

    def __init__(self, key: tuple[str, str, int]):
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.loop = asyncio.get_running_loop()
        self.closed = False
        self.idle_since = 0.0
        # One timer per connection, not one made and cancelled per wait: a wait sets the time
        # its event is due by, and the timer, when it fires, finds nothing awaited, waits out a
        # later due time, or times the reply out. Re-armed only for a due time before it.
        self._due: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._until: float | None = None  # the request's total deadline (loop time), if any
        self._total_s = 0.0
        self._start()

    def _start(self) -> None:
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.headers_done = self.complete = self.keep_alive = self.until_close = False
        self.error: Exception | None = None
        self.in_flight = False
        self._waiter: asyncio.Future | None = None
        self._paused = False

    # -- asyncio.Protocol
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if not self.in_flight:  # nothing was asked: a server talking out of turn is not reused
            self.error = httpx.RemoteProtocolError("the engine sent data with no request in flight")
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self.error = httpx.RemoteProtocolError(f"malformed reply from the engine: {exc}")
            self.close()
            self._wake()
            return
        if self.buffered > _READ_AHEAD and not self._paused and not self.complete:
            self._paused = True
            self.transport.pause_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.in_flight or self.complete:
            return
        if self.headers_done and self.until_close and exc is None:
            self.complete = True  # a body without a length ends with the connection
        elif self.error is None:
            self.error = httpx.RemoteProtocolError(
                "Server disconnected without sending a response" if not self.headers_done
                else "Server disconnected before the end of the reply"
            )  # fmt: skip
        self._wake()

    # -- httptools callbacks
    def on_message_begin(self) -> None:
        if self.complete:  # aborts the parse: the connection is dropped, the reply already read stands
            raise httpx.RemoteProtocolError("the engine sent a second reply to one request")

    def on_status(self, reason: bytes) -> None:
        self.reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:  # an informational reply (103 Early Hints): the real one follows
            self.headers, self.reason = [], b""
            return
        self.status = status
        self.headers_done = True
        if status not in _NO_BODY:
            names = {n.lower() for n, _ in self.headers}
            self.until_close = b"content-length" not in names and b"transfer-encoding" not in names
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        self._wake()

    def on_message_complete(self) -> None:
        if not self.headers_done:  # the end of an informational reply
            return
        self.keep_alive = self.parser.should_keep_alive()
        self.complete = True
        self._wake()

    # -- the request side
    def send(self, head: bytes, content: Content | None, until: float | None = None, total_s: float = 0.0) -> None:
        """Write a request; ``until``: the loop time its whole reply must be in by."""
        self._start()
        self.in_flight = True
        self._until, self._total_s = until, total_s
        if content is not None and not isinstance(content, bytes):  # pieces: one writev, no join
            self.transport.writelines((head, *content))
        elif content and len(content) > 65536:
            self.transport.writelines((head, content))
        else:
            self.transport.write(head + content if content else head)

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def wait(self, read_s: float | None) -> None:
        """Until the reply's next event; raises the connection's error or ``ReadTimeout`` (nothing
        for ``read_s``, or the request's total deadline passed)."""
        if self.error is None:
            due = self.loop.time() + read_s if read_s else None
            if self._until is not None and (due is None or self._until < due):
                due = self._until
            self._waiter = self.loop.create_future()
            if due is not None:
                self._due = due
                if self._timer is None or due < self._timer_at:
                    if self._timer is not None:
                        self._timer.cancel()
                    self._arm(due)
            try:
                await self._waiter
            finally:
                self._waiter = None
                self._due = None
        if self.error is not None and not self.complete:  # a reply read whole stands
            raise self.error

    def _arm(self, at: float) -> None:
        self._timer_at = at
        self._timer = self.loop.call_at(at, self._check_due)

    def _check_due(self) -> None:
        self._timer = None
        due = self._due
        if due is None or self.closed:
            return  # nothing awaited now; the next wait arms again
        if self.loop.time() < due:
            self._arm(due)
            return
        if self._until is not None and due >= self._until:
            self.error = httpx.ReadTimeout(f"no complete reply within {self._total_s:g} s")
        else:
            self.error = httpx.ReadTimeout("the engine sent nothing for longer than the read timeout")
        self.close()
        self._wake()

    def take(self) -> bytes:
        """The body received so far (and reading resumed if it was paused)."""
        data = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
        self.chunks, self.buffered = [], 0
        if self._paused and not self.closed:
            self._paused = False
            self.transport.resume_reading()
        return data

    def reusable(self) -> bool:
        return self.complete and self.keep_alive and not self.closed and self.error is None and not self.chunks

    def close(self) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.transport is not None:
            self.transport.abort()


class Reply:
    """An engine's reply on the direct path: the status, then the whole body, its pieces or its
    lines. ``close()`` hands a fully read connection back to the pool (and drops one that is not)."""

    __slots__ = ("_conn", "_pool", "_read_s", "status", "headers", "reason")

    def __init__(self, conn: _Connection, pool: EngineTransport, read_s: float | None):
        self._conn, self._pool, self._read_s = conn, pool, read_s
        self.status, self.headers, self.reason = conn.status, conn.headers, conn.reason

    async def read(self) -> bytes:
        conn = self._conn
        while not conn.complete:
            await conn.wait(self._read_s)
        return conn.take()

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (SSE frames are not held back)."""
        conn = self._conn
        while True:
            if conn.chunks:
                yield conn.take()
            elif conn.complete:
                return
            else:
                await conn.wait(self._read_s)

    async def lines(self) -> AsyncIterator[str]:
        """The body's lines as they arrive, without their line breaks. A long prompt's echoed
        logprobs are one SSE line of megabytes: its pieces are joined once, when it ends."""
        pending: list[bytes] = []  # the current line's pieces
        async for chunk in self.chunks():
            if b"\n" not in chunk:
                pending.append(chunk)
                continue
            parts = chunk.split(b"\n")
            if pending:
                parts[0] = b"".join((*pending, parts[0]))
            pending = [parts.pop()]
            for part in parts:
                yield part.rstrip(b"\r").decode("utf-8", "replace")
        if last := b"".join(pending):
            yield last.rstrip(b"\r").decode("utf-8", "replace")

    def close(self) -> None:
        if self._conn is not None:
            self._pool.release(self._conn)
            self._conn = None


class _Body(httpx.AsyncByteStream):
    def __init__(self, reply: Reply):
        self._reply = reply

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._reply.chunks():
            yield chunk

    async def aclose(self) -> None:
        self._reply.close()


class EngineTransport(httpx.AsyncBaseTransport):
    """Keep-alive connections per (scheme, host, port), newest reused first; no limit on their
    number (the proxy's admission control bounds what is in flight); idle ones are dropped after
    ``keepalive_s``."""

    def __init__(self, *, keepalive_s: float = KEEPALIVE_S):
        self._keepalive_s = keepalive_s
        self._idle: dict[tuple[str, str, int], list[_Connection]] = {}
        self._targets: dict[str, _Target] = {}
        self._ssl: ssl.SSLContext | None = None

    def _target_of(self, url: str) -> _Target:
        t = self._targets.get(url)
        if t is None:
            if len(self._targets) > 1024:  # engine URLs are a handful; bound a caller that varies queries
                self._targets.clear()
            t = self._targets[url] = _target(url)
        return t

    async def _acquire(self, key: tuple[str, str, int], connect_s: float | None, loop: asyncio.AbstractEventLoop,
                       now: float) -> _Connection:  # fmt: skip
        idle = self._idle.get(key)
        if idle:
            while idle:
                conn = idle.pop()
                if not conn.closed and now - conn.idle_since < self._keepalive_s:
                    return conn
                conn.close()
        scheme, host, port = key
        if scheme == "https" and self._ssl is None:
            self._ssl = ssl.create_default_context()
        tls = self._ssl if scheme == "https" else None
        try:
            async with asyncio.timeout(connect_s):
                _, conn = await loop.create_connection(lambda: _Connection(key), host, port, ssl=tls)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"no connection to {host}:{port} within {connect_s:g} s") from None
        except (OSError, ssl.SSLError) as exc:
            raise httpx.ConnectError(f"cannot connect to {host}:{port}: {exc}") from exc
        return conn

    def release(self, conn: _Connection) -> None:
        if conn.reusable():
            conn.in_flight = False
            conn.idle_since = conn.loop.time()
            self._idle.setdefault(conn.key, []).append(conn)
        else:
            conn.close()

    async def _send(self, method: str, t: _Target, lines: list[bytes], content: Content | None,
                    connect_s: float | None, read_s: float | None, total_s: float | None = None) -> Reply:  # fmt: skip
        head = b"%s %s HTTP/1.1\r\n%b\r\n" % (method.encode("ascii"), t.target, b"".join(lines))
        loop = asyncio.get_running_loop()  # once a call: in Python 3.11 each asks the kernel for the pid
        now = loop.time()
        until = now + total_s if total_s else None
        conn = await self._acquire(t.key, connect_s, loop, now)
        try:
            try:
                conn.send(head, content, until, total_s or 0.0)
            except (OSError, RuntimeError) as exc:  # the transport is closing under us
                raise httpx.WriteError(str(exc) or type(exc).__name__) from exc
            while not conn.headers_done:
                await conn.wait(read_s)
        except BaseException:
            conn.close()
            raise
        return Reply(conn, self, read_s)

    async def open(
        self, method: str, url: str, *, content: Content | None, headers: dict[str, str], connect_s: float, read_s: float,
        total_s: float | None = None,
    ) -> Reply:
        """Send one request and return its reply once the status line and headers are in.
        ``content``: the body, one buffer or pieces (engines/json_body.py). ``total_s``: the whole
        reply, connecting included, must be in within it, or reading it raises ``ReadTimeout``
        (no timer of its own: the connection's, with the read timeout)."""
        t = self._target_of(url)
        lines = [b"host: %s\r\n" % t.host_header]
        for name, value in headers.items():
            _check_header(name, value)
            lines.append(f"{name}: {value}\r\n".encode("latin-1"))
        if content is not None or method in ("POST", "PUT", "PATCH"):
            lines.append(b"content-length: %d\r\n" % content_length(content))
        return await self._send(method, t, lines, content, connect_s, read_s, total_s)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        t = request.extensions.get("timeout") or {}
        try:
            content = request.content
        except httpx.RequestNotRead:  # a streamed upload: read it (engine bodies are JSON in memory)
            content = await request.aread()
        target = self._target_of(str(request.url))
        lines = [b"%s: %s\r\n" % (k, v) for k, v in request.headers.raw]
        if content and b"content-length" not in {k.lower() for k, _ in request.headers.raw}:
            lines.append(b"content-length: %d\r\n" % len(content))
        reply = await self._send(request.method, target, lines, content or None, t.get("connect"), t.get("read"))
        return httpx.Response(
            reply.status, headers=reply.headers, stream=_Body(reply), request=request,
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": reply.reason},
        )  # fmt: skip

    async def aclose(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
