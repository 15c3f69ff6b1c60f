"""The engine client's wire: ``aiohttp`` under an ``httpx`` transport, and a direct path beside it.

httpx's own transport (httpcore on anyio, h11 in pure Python) costs about 1.6 ms of CPU per
``/generate`` at one request in flight and 4.5 ms at 64 (its pool scans every connection on each
request) on a small machine; aiohttp's C-accelerated client does the same request for about
0.3 ms. Even over aiohttp, httpx's request and response models (URL and header normalisation,
auth and cookie flows, the response body stream) add about 0.6 ms per call, so every engine call
(``engines.http.Http``) uses ``open`` directly: aiohttp with the request as bytes, the reply as
bytes or lines. ``handle_async_request`` keeps the transport an httpx transport: it is where
``respx`` intercepts in wire-format tests (tests/conftest.py routes ``open`` through it) and what
a pass-through route sends with. ``splice bench overhead`` shows the difference end to end.

Errors come back as the httpx exceptions httpcore would raise, so ``map_transport_error`` sorts
them the same way: a refused or failed connect is ``ConnectError``, a server that hangs up is
``RemoteProtocolError``, a timeout is a ``TimeoutException``.
"""

from __future__ import annotations

import asyncio
from contextlib import contextmanager
from typing import AsyncIterator, Iterator

import aiohttp
import httpx

CHUNK = 64 * 1024
_SKIPPED = ("Accept-Encoding", "User-Agent", "Content-Type")  # sent only when the caller gives them


@contextmanager
def _mapped() -> Iterator[None]:
    try:
        yield
    except httpx.HTTPError:
        raise
    except aiohttp.ConnectionTimeoutError as exc:
        raise httpx.ConnectTimeout(str(exc) or "connect timed out") from exc
    except (aiohttp.ServerTimeoutError, asyncio.TimeoutError) as exc:
        raise httpx.ReadTimeout(str(exc) or "read timed out") from exc
    except aiohttp.ClientConnectorError as exc:
        raise httpx.ConnectError(str(exc)) from exc
    except aiohttp.ServerDisconnectedError as exc:
        raise httpx.RemoteProtocolError(str(exc) or "Server disconnected without sending a response") from exc
    except aiohttp.ClientPayloadError as exc:
        raise httpx.RemoteProtocolError(str(exc)) from exc
    except aiohttp.InvalidURL as exc:
        raise httpx.UnsupportedProtocol(str(exc)) from exc
    except aiohttp.ClientResponseError as exc:  # a response the parser rejected
        raise httpx.RemoteProtocolError(str(exc)) from exc
    except (aiohttp.ClientError, OSError) as exc:
        raise httpx.ReadError(str(exc) or type(exc).__name__) from exc


class _Body(httpx.AsyncByteStream):
    """The response body, read from aiohttp as it arrives (SSE frames are not held back)."""

    def __init__(self, resp: aiohttp.ClientResponse):
        self._resp = resp

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _mapped():
            async for chunk in self._resp.content.iter_chunked(CHUNK):
                yield chunk

    async def aclose(self) -> None:
        self._resp.release()  # back to the pool when fully read; closed otherwise


class Reply:
    """An engine's reply on the direct path: the status, then the whole body or its lines.
    ``close()`` hands a fully read connection back to the pool (and drops one that is not)."""

    def __init__(self, resp: aiohttp.ClientResponse):
        self._resp = resp
        self.status = resp.status

    async def read(self) -> bytes:
        with _mapped():
            return await self._resp.read()

    async def lines(self) -> AsyncIterator[str]:
        """The body's lines as they arrive, without their line breaks. Split here rather than
        with aiohttp's ``readline``, which refuses lines over 128 KiB (a long prompt's echoed
        logprobs are one SSE line of megabytes)."""
        pending: list[bytes] = []  # the current line's pieces: joined once, however long it is
        with _mapped():
            async for chunk in self._resp.content.iter_chunked(CHUNK):
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
        self._resp.release()


KEEPALIVE_S = 4.0
"""How long an idle engine connection is reused. Below the engines' own keep-alive (vLLM's
``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` and SGLang's uvicorn both close idle connections after 5 s): a
request written on a connection the server is closing dies with "Server disconnected", and POSTs
are not retried. aiohttp's default (15 s) lost a ``/pause`` that way after a 6 s quiet spell."""


class AiohttpTransport(httpx.AsyncBaseTransport):
    """One ``aiohttp.ClientSession`` (made on first use, inside the running loop), no connection
    limit (the proxy's admission control bounds what is in flight), HTTP/1.1 keep-alive."""

    def __init__(self, *, keepalive_s: float = KEEPALIVE_S):
        self._keepalive_s = keepalive_s
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=self._keepalive_s)
            # No trust_env: aiohttp would read the proxy variables and ~/.netrc on every request
            # (a tenth of the proxy's CPU under load); engines are reached directly.
            self._session = aiohttp.ClientSession(connector=connector, trust_env=False, auto_decompress=False)
        return self._session

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        t = request.extensions.get("timeout") or {}
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=t.get("connect"), sock_read=t.get("read"))
        try:
            data = request.content or None
        except httpx.RequestNotRead:  # a streamed upload: read it (engine bodies are JSON in memory)
            data = await request.aread() or None
        with _mapped():
            resp = await self._client().request(
                request.method, str(request.url), data=data, headers=request.headers.multi_items(),
                allow_redirects=False, timeout=timeout, skip_auto_headers=_SKIPPED,
            )  # fmt: skip
        return httpx.Response(
            resp.status, headers=resp.raw_headers, stream=_Body(resp), request=request,
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": (resp.reason or "").encode()},
        )  # fmt: skip

    async def open(
        self, method: str, url: str, *, content: bytes | None, headers: dict[str, str], connect_s: float, read_s: float
    ) -> Reply:
        """Send one request and return its reply once the status line and headers are in; aiohttp
        errors come out as the httpx exceptions ``handle_async_request`` raises."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_s, sock_read=read_s)
        with _mapped():
            resp = await self._client().request(
                method, url, data=content, headers=headers, allow_redirects=False, timeout=timeout,
                skip_auto_headers=_SKIPPED,
            )  # fmt: skip
        return Reply(resp)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
