"""The engine client's direct path over a real socket (no respx): what goes out, what comes back.

References are independent of Splice: the bytes a real aiohttp server received, Python's own
line splitting of the body it sent, and httpx's basic-auth header.
"""

from __future__ import annotations

import asyncio
import random

import httpx
import orjson
import pytest
from aiohttp import web

from engines.http import Http, basic_auth
from engines.http_transport import KEEPALIVE_S, AiohttpTransport
from engines.types import EngineRejected


def _serve(handler):
    """Start an aiohttp server on a free loopback port; returns (runner, url)."""

    async def start():
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        return runner, f"http://127.0.0.1:{port}"

    return start()


def test_sse_lines_split_across_any_chunking_including_a_multi_megabyte_line():
    rng = random.Random(7)
    frames = [{"i": i, "pad": "x" * rng.choice([0, 10, 70_000, 3_000_000])} for i in range(8)]
    body = b"".join(b"data: " + orjson.dumps(f) + (b"\r\n\r\n" if i % 2 else b"\n\n") for i, f in enumerate(frames))
    body += b"data: [DONE]"  # no final line break

    async def handler(request):
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        pos = 0
        while pos < len(body):
            n = rng.choice([1, 7, 4096, 65_537, 1_000_000])
            await resp.write(body[pos : pos + n])
            pos += n
        await resp.write_eof()
        return resp

    async def go():
        runner, url = await _serve(handler)
        async with httpx.AsyncClient(transport=AiohttpTransport()) as client:
            http = Http(client, url)
            try:
                async with http.stream("/generate", {"x": 1}, timeout=30) as reply:
                    lines = [line async for line in reply.lines()]
                async with http.stream("/generate", {"x": 1}, timeout=30) as reply:
                    got = [f async for f in http.sse(reply, "/generate")]
            finally:
                await runner.cleanup()
        return lines, got

    lines, got = asyncio.run(go())
    assert lines == body.decode().splitlines()
    assert got == frames


def test_request_sends_json_auth_and_headers_and_maps_4xx():
    seen: list[tuple[str, str, dict, bytes]] = []

    async def handler(request):
        seen.append((request.method, request.path, dict(request.headers), await request.read()))
        if request.path == "/bad":
            return web.json_response({"error": {"message": "no"}}, status=400)
        return web.json_response({"ok": True})

    async def go():
        runner, url = await _serve(handler)
        bare = url.replace("http://", "http://us%40er:p%3Ass@")
        async with httpx.AsyncClient(transport=AiohttpTransport()) as client:
            http = Http(client, bare)
            try:
                ok = await http.request("POST", "/generate", body={"input_ids": [1, 2]}, timeout=30, headers={"X-A": "b"})
                with pytest.raises(EngineRejected):
                    await http.request("GET", "/bad", timeout=30)
                status = await http.probe("GET", "/anything")
            finally:
                await runner.cleanup()
        return ok, status

    ok, status = asyncio.run(go())
    assert ok == {"ok": True} and status == 200
    method, path, headers, raw = seen[0]
    assert (method, path, orjson.loads(raw)) == ("POST", "/generate", {"input_ids": [1, 2]})
    assert headers["Content-Type"] == "application/json" and headers["X-A"] == "b"
    # the credentials of the URL, decoded, as httpx itself would send them
    reference = next(httpx.BasicAuth("us@er", "p:ss").sync_auth_flow(httpx.Request("GET", "http://h/")))
    assert headers["Authorization"] == reference.headers["authorization"] == basic_auth("us@er", "p:ss")


def test_a_plain_httpx_client_is_refused_with_a_clear_message():
    with pytest.raises(TypeError, match="AiohttpTransport"):
        Http(httpx.AsyncClient(), "http://127.0.0.1:1")


async def _ok(request):
    from starlette.responses import JSONResponse

    return JSONResponse({"ok": True})


def _call_twice_with_a_stall(call, stall_s: float, server_keepalive_s: float = 5,
                             client_keepalive_s: float = KEEPALIVE_S):
    """``call(client, url)``, then block the event loop for ``stall_s`` (as a busy caller does),
    then ``call`` again on the same client; the second call's result. The server is uvicorn
    (default keep-alive 5 s), as vLLM's and SGLang's are."""
    import time

    from starlette.applications import Starlette
    from starlette.routing import Route

    from tests.fakes.serve import serve_in_thread

    paths = ["/pause", "/pause_generation", "/continue_generation", "/resume"]
    app = Starlette(routes=[Route(p, _ok, methods=["POST"]) for p in paths])
    url, stop = serve_in_thread(app, timeout_keep_alive=server_keepalive_s)

    async def go():
        async with httpx.AsyncClient(transport=AiohttpTransport(keepalive_s=client_keepalive_s)) as client:
            await call(client, url)
            time.sleep(stall_s)
            return await call(client, url)

    try:
        return asyncio.run(go())
    finally:
        stop()


async def _raw_post(client, url) -> bytes:
    """A POST on the transport's direct path (no retry, no error mapping)."""
    reply = await client._transport.open("POST", url + "/pause", content=b"{}", headers={}, connect_s=5, read_s=5)
    try:
        return await reply.read()
    finally:
        reply.close()


def _two_posts_with_a_stall(stall_s: float, **keepalives) -> bytes:
    return _call_twice_with_a_stall(_raw_post, stall_s, **keepalives)


def test_a_connection_the_engine_closed_while_idle_is_not_reused():
    """uvicorn's default keep-alive (5 s, what vLLM and SGLang run with) against the client's
    default: a POST after a quiet spell longer than the server's keep-alive gets its answer."""
    assert orjson.loads(_two_posts_with_a_stall(5.5)) == {"ok": True}


def test_a_client_keep_alive_longer_than_the_servers_loses_the_post():
    """Why the client's keep-alive is the shorter one: the other way round, the second POST is
    written on a connection the server has closed, and aiohttp does not retry a POST."""
    with pytest.raises(httpx.RemoteProtocolError):
        _two_posts_with_a_stall(1.0, server_keepalive_s=0.5, client_keepalive_s=2.0)
    assert orjson.loads(_two_posts_with_a_stall(1.0, server_keepalive_s=0.5, client_keepalive_s=0.3)) == {"ok": True}


def _second_call_after_the_server_closed(call) -> None:
    """The server's keep-alive (0.5 s) shorter than the client's (2 s): the second call's request
    goes out on the connection the server has just closed."""
    _call_twice_with_a_stall(call, 1.0, server_keepalive_s=0.5, client_keepalive_s=2.0)


def test_an_idempotent_call_is_retried_on_a_connection_the_engine_closed():
    """pause/resume may run twice, so a connection that died before the answer costs one retry,
    not a failed weight update; a call that is not marked idempotent still fails (the pool
    decides whether a generation runs again)."""
    from engines.sglang import SGLangClient
    from engines.types import EngineUnavailable
    from engines.vllm import VLLMClient

    async def plain(client, url):
        await Http(client, url).request("POST", "/pause", timeout=5, allow_empty=True)

    async def idempotent(client, url):
        await Http(client, url).request("POST", "/pause", timeout=5, allow_empty=True, idempotent=True)

    with pytest.raises(EngineUnavailable, match="RemoteProtocolError"):
        _second_call_after_the_server_closed(plain)
    _second_call_after_the_server_closed(idempotent)

    async def sglang_pause_resume(client, url):
        engine = SGLangClient(client, url)
        await engine.pause()
        await engine.resume()

    async def vllm_pause_resume(client, url):
        engine = VLLMClient(client, url)
        await engine.pause()
        await engine.resume()

    _second_call_after_the_server_closed(sglang_pause_resume)
    _second_call_after_the_server_closed(vllm_pause_resume)
