"""An ``httpx`` transport that sends over ``aiohttp``: the engine client's hot path.

httpx's own transport (httpcore on anyio, h11 in pure Python) costs about 1.6 ms of CPU per
``/generate`` at one request in flight and 4.5 ms at 64 (its pool scans every connection on each
request) on a small machine; aiohttp's C-accelerated client does the same request for about
0.3 ms. Keeping httpx's ``AsyncClient`` in front keeps one API for every engine call and keeps
``respx`` usable for wire-format tests (``respx``'s ``httpx`` mocker patches the client, whatever
its transport). ``splice bench overhead`` shows the difference end to end.

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


class AiohttpTransport(httpx.AsyncBaseTransport):
    """One ``aiohttp.ClientSession`` (made on first use, inside the running loop), no connection
    limit (the proxy's admission control bounds what is in flight), HTTP/1.1 keep-alive."""

    def __init__(self, *, keepalive_s: float = 15.0):
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
                allow_redirects=False, timeout=timeout, skip_auto_headers=("Accept-Encoding", "User-Agent", "Content-Type"),
            )  # fmt: skip
        return httpx.Response(
            resp.status, headers=resp.raw_headers, stream=_Body(resp), request=request,
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": (resp.reason or "").encode()},
        )  # fmt: skip

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
