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
from engines.http_transport import KEEPALIVE_S, EngineTransport
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
        async with httpx.AsyncClient(transport=EngineTransport()) as client:
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
        async with httpx.AsyncClient(transport=EngineTransport()) as client:
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
    with pytest.raises(TypeError, match="EngineTransport"):
        Http(httpx.AsyncClient(), "http://127.0.0.1:1")


async def _ok(request):
    from starlette.responses import JSONResponse

    return JSONResponse({"ok": True})


def _until_the_server_closed(client, limit_s: float = 30.0) -> None:
    """Block until every idle connection's socket reads end-of-file: the server has closed it.
    The event loop does not run meanwhile, so the client has not noticed (as a busy caller would
    not). A fixed stall raced the server's keep-alive timer on a loaded machine."""
    import os
    import select
    import socket
    import time

    deadline = time.monotonic() + limit_s
    idle = [conn for conns in client._transport._idle.values() for conn in conns]
    assert idle, "no idle connection to wait on"
    for conn in idle:
        with socket.socket(fileno=os.dup(conn.transport.get_extra_info("socket").fileno())) as sock:
            while True:
                assert time.monotonic() < deadline, "the server kept the idle connection open"
                if select.select([sock], [], [], 0.05)[0] and sock.recv(1, socket.MSG_PEEK) == b"":
                    break


def _call_twice_with_a_stall(call, stall_s: float, server_keepalive_s: float = 5,
                             client_keepalive_s: float = KEEPALIVE_S, until_closed: bool = False):
    """``call(client, url)``, then block the event loop for ``stall_s`` (as a busy caller does),
    and with ``until_closed`` until the server has closed the connection, then ``call`` again on
    the same client; the second call's result. The server is uvicorn (default keep-alive 5 s),
    as vLLM's and SGLang's are."""
    import time

    from starlette.applications import Starlette
    from starlette.routing import Route

    from tests.fakes.serve import serve_in_thread

    paths = ["/pause", "/pause_generation", "/continue_generation", "/resume"]
    app = Starlette(routes=[Route(p, _ok, methods=["POST"]) for p in paths])
    url, stop = serve_in_thread(app, timeout_keep_alive=server_keepalive_s)

    async def go():
        async with httpx.AsyncClient(transport=EngineTransport(keepalive_s=client_keepalive_s)) as client:
            await call(client, url)
            time.sleep(stall_s)
            if until_closed:
                _until_the_server_closed(client)
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


def _two_posts_with_a_stall(stall_s: float, **options) -> bytes:
    return _call_twice_with_a_stall(_raw_post, stall_s, **options)


def test_a_connection_the_engine_closed_while_idle_is_not_reused():
    """uvicorn's default keep-alive (5 s, what vLLM and SGLang run with) against the client's
    default: a POST after a quiet spell longer than the server's keep-alive gets its answer."""
    assert orjson.loads(_two_posts_with_a_stall(5.5)) == {"ok": True}


def test_a_client_keep_alive_longer_than_the_servers_loses_the_post():
    """Why the client's keep-alive is the shorter one: the other way round, the second POST is
    written on a connection the server has closed, and aiohttp does not retry a POST."""
    with pytest.raises(httpx.RemoteProtocolError):
        _two_posts_with_a_stall(0.5, server_keepalive_s=0.5, client_keepalive_s=30.0, until_closed=True)
    assert orjson.loads(_two_posts_with_a_stall(1.0, server_keepalive_s=0.5, client_keepalive_s=0.3)) == {"ok": True}


def _second_call_after_the_server_closed(call) -> None:
    """The server's keep-alive (0.5 s) shorter than the client's (30 s): the second call's request
    goes out on the connection the server has just closed."""
    _call_twice_with_a_stall(call, 0.5, server_keepalive_s=0.5, client_keepalive_s=30.0, until_closed=True)


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


async def _raw_server(script):
    """A loopback server speaking raw bytes: ``script(reader, writer)`` per connection. Returns
    (server, url, peers): ``peers`` lists each accepted connection's client port."""
    peers: list[int] = []

    async def on_connect(reader, writer):
        peers.append(writer.get_extra_info("peername")[1])
        try:
            await script(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", peers


async def _read_request(reader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    n = next((int(v) for k, _, v in (h.partition(b":") for h in head.split(b"\r\n")) if k.lower() == b"content-length"), 0)
    return head + (await reader.readexactly(n) if n else b"")


async def _requests(reader):
    """Each request read off a connection, until the client closes it."""
    while True:
        try:
            yield await _read_request(reader)
        except asyncio.IncompleteReadError:
            return


async def _answer_paths(reader, writer, answer) -> None:
    """Every request on the connection answered by ``answer(path, head, body, writer)``: ``body``
    is ``{"path": ...}`` as JSON, ``head`` a 200's status line and headers for it."""
    while True:
        try:
            path = (await _read_request(reader)).split(b" ")[1]
        except asyncio.IncompleteReadError:
            return
        body = b'{"path": "%s"}' % path
        await answer(path, b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body), body, writer)
        await writer.drain()


def test_keep_alive_reuses_one_connection_and_sends_a_well_formed_request():
    """Three calls, one connection; the request bytes parse with the standard library's HTTP
    server parser (an independent reader) into the method, path, headers and body sent."""
    import http.server
    import io

    seen: list[bytes] = []

    async def script(reader, writer):
        while True:
            try:
                seen.append(await _read_request(reader))
            except asyncio.IncompleteReadError:
                return
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{\"ok\":true}")
            await writer.drain()

    async def go():
        server, url, peers = await _raw_server(script)
        async with server, httpx.AsyncClient(transport=EngineTransport()) as client:
            http = Http(client, url)
            out = [await http.request("POST", "/generate?x=1", body={"input_ids": [i]}, timeout=5) for i in range(3)]
        return out, peers, url

    out, peers, url = asyncio.run(go())
    assert out == [{"ok": True}] * 3 and len(peers) == 1
    for i, raw in enumerate(seen):
        head, _, body = raw.partition(b"\r\n\r\n")

        class Req(http.server.BaseHTTPRequestHandler):
            def __init__(self):  # parse only: no socket
                self.rfile, self.wfile = io.BytesIO(head + b"\r\n\r\n"), io.BytesIO()
                self.raw_requestline = self.rfile.readline()
                assert self.parse_request()

        req = Req()
        assert (req.command, req.path, req.request_version) == ("POST", "/generate?x=1", "HTTP/1.1")
        assert req.headers["Host"] == url.removeprefix("http://")
        assert req.headers["Content-Type"] == "application/json" and int(req.headers["Content-Length"]) == len(body)
        assert orjson.loads(body) == {"input_ids": [i]}


def test_a_body_that_ends_with_the_connection_is_read_whole_and_the_connection_dropped():
    async def script(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n")
        for part in (b"hel", b"lo ", b"world"):
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(0.01)

    async def go():
        server, url, peers = await _raw_server(script)
        async with server, httpx.AsyncClient(transport=EngineTransport()) as client:
            bodies = []
            for _ in range(2):
                reply = await client._transport.open("GET", url + "/x", content=None, headers={}, connect_s=5, read_s=5)
                bodies.append(await reply.read())
                reply.close()
        return bodies, peers

    bodies, peers = asyncio.run(go())
    assert bodies == [b"hello world"] * 2 and len(peers) == 2


def _one_call(script, *, timeout: float = 5, **kw):
    """``Http.request`` against a raw server; the exception it raised (None when it answered)."""

    async def go():
        server, url, _ = await _raw_server(script)
        async with server, httpx.AsyncClient(transport=EngineTransport()) as client:
            try:
                await Http(client, url).request("POST", "/generate", body={}, timeout=timeout, **kw)
            except Exception as exc:  # noqa: BLE001 - the test looks at it
                return exc
        return None

    return asyncio.run(go())


def test_transport_failures_map_to_the_errors_the_pool_fails_over_on():
    from engines.types import EngineBadResponse, EngineTimeout, EngineUnavailable

    async def hang_up_mid_body(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n{\"a\":")

    async def hang_up_at_once(reader, writer):
        await _read_request(reader)

    async def garbage(reader, writer):
        await _read_request(reader)
        writer.write(b"SPDY/9 banana\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    async def silent(reader, writer):
        await _read_request(reader)
        await asyncio.sleep(3)

    async def not_json(reader, writer):
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\nabc")
        await writer.drain()

    for script, kind, text in ((hang_up_mid_body, EngineUnavailable, "before the end of the reply"),
                               (hang_up_at_once, EngineUnavailable, "without sending a response"),
                               (garbage, EngineUnavailable, "malformed reply"),
                               (silent, EngineTimeout, ""),
                               (not_json, EngineBadResponse, "malformed JSON")):  # fmt: skip
        # only the silent server is meant to outlast the deadline; the others answer at once
        exc = _one_call(script, timeout=0.5 if script is silent else 10)
        assert isinstance(exc, kind) and text in str(exc), (script.__name__, exc)

    async def refused():
        async with httpx.AsyncClient(transport=EngineTransport()) as client:
            with pytest.raises(EngineUnavailable, match="ConnectError"):
                await Http(client, "http://127.0.0.1:1").request("GET", "/x", timeout=5)

    asyncio.run(refused())


def test_a_read_timeout_and_a_cancelled_call_leave_no_connection_to_reuse():
    """The server answers the first request on a connection only after 1 s; a call given up on
    before that (read timeout, or its task cancelled) must not leave that connection in the
    pool, or the next call would read the stale answer."""
    n = 0

    async def script(reader, writer):
        nonlocal n
        async for _ in _requests(reader):
            n += 1
            body = orjson.dumps({"n": n})
            await asyncio.sleep(1.0 if n <= 2 else 0)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()

    async def go():
        server, url, peers = await _raw_server(script)
        async with server, httpx.AsyncClient(transport=EngineTransport()) as client:
            t = client._transport
            with pytest.raises(httpx.ReadTimeout):
                await t.open("POST", url + "/a", content=b"{}", headers={}, connect_s=5, read_s=0.2)
            task = asyncio.ensure_future(t.open("POST", url + "/b", content=b"{}", headers={}, connect_s=5, read_s=5))
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            reply = await t.open("POST", url + "/c", content=b"{}", headers={}, connect_s=5, read_s=5)
            got = orjson.loads(await reply.read())
            reply.close()
        return got, peers

    got, peers = asyncio.run(go())
    assert got == {"n": 3} and len(peers) == 3


def test_a_plain_httpx_call_on_the_transport_and_a_header_with_a_line_break():
    async def handler(request):
        return web.Response(body=b"x" * 100_000, headers={"X-Engine": "yes"}, status=201)

    async def go():
        runner, url = await _serve(handler)
        try:
            async with httpx.AsyncClient(transport=EngineTransport()) as client:
                resp = await client.get(url + "/models")
                with pytest.raises(httpx.LocalProtocolError):
                    await client._transport.open("GET", url, content=None, headers={"x": "a\r\nb: c"}, connect_s=5, read_s=5)
        finally:
            await runner.cleanup()
        return resp

    resp = asyncio.run(go())
    assert resp.status_code == 201 and resp.headers["x-engine"] == "yes" and resp.content == b"x" * 100_000
    assert resp.reason_phrase == "Created"


def test_a_reply_closed_before_its_body_is_read_does_not_go_back_to_the_pool():
    """``probe`` closes a reply once its status is in. The rest of that body must not be read
    as the answer to the next request on the same connection."""

    async def answer(path, head, body, writer):
        if path == b"/slow":  # half the body now, the rest later
            writer.write(head + body[:5])
            await writer.drain()
            await asyncio.sleep(0.3)
            body = body[5:]
        writer.write(head + body)

    async def go():
        server, url, peers = await _raw_server(lambda reader, writer: _answer_paths(reader, writer, answer))
        async with server, httpx.AsyncClient(transport=EngineTransport()) as client:
            http = Http(client, url)
            assert await http.probe("GET", "/slow") == 200
            got = await http.request("GET", "/fast", timeout=5)
        return got, peers

    got, peers = asyncio.run(go())
    assert got == {"path": "/fast"} and len(peers) == 2


def test_an_informational_reply_is_skipped_and_a_second_reply_drops_the_connection():
    """``103 Early Hints`` before the answer is not the answer; a server that answers one request
    twice leaves its first answer read and its connection unused."""

    async def answer(path, head, body, writer):
        reply = head + body
        if path == b"/hints":
            writer.write(b"HTTP/1.1 103 Early Hints\r\nlink: </x>\r\n\r\n" + reply)
        elif path == b"/twice":
            writer.write(reply + reply)
        else:
            writer.write(reply)

    async def go():
        server, url, peers = await _raw_server(lambda reader, writer: _answer_paths(reader, writer, answer))
        async with server, httpx.AsyncClient(transport=EngineTransport()) as client:
            http = Http(client, url)
            got = [await http.request("GET", p, timeout=5) for p in ("/hints", "/after", "/twice")]
            await asyncio.sleep(0.1)
            got.append(await http.request("GET", "/last", timeout=5))
        return got, peers

    got, peers = asyncio.run(go())
    assert [g["path"] for g in got] == ["/hints", "/after", "/twice", "/last"]
    assert len(peers) == 2  # the connection that carried a second reply was not reused


def test_a_long_prompt_sent_as_pieces_arrives_as_the_exact_json_body():
    """A session's long prompt goes out as the JSON pieces kept from its earlier turns (one
    ``writev``): the real server's own JSON parser reads each turn's exact ids and fields."""
    import numpy as np

    from engines.ids_json import IdsJson

    got: list[dict] = []

    async def handler(request):
        got.append(await request.json())
        return web.json_response({"ok": True})

    async def go():
        runner, url = await _serve(handler)
        enc = IdsJson()
        prompt = np.arange(100_000, dtype=np.int32) % 151_000
        sent = []
        try:
            async with httpx.AsyncClient(transport=EngineTransport()) as client:
                http = Http(client, url)
                for turn in range(3):
                    prompt = np.concatenate([prompt, np.array([turn, 198, 151_644], dtype=np.int32)])
                    sent.append(prompt.tolist())
                    body = {"input_ids": enc("session", prompt), "sampling_params": {"max_new_tokens": 8}, "rid": f"r{turn}"}
                    assert await http.request("POST", "/generate", body=body, timeout=10) == {"ok": True}
        finally:
            await runner.cleanup()
        return enc, sent

    enc, sent = asyncio.run(go())
    assert enc.reused == 2
    assert got == [{"input_ids": ids, "sampling_params": {"max_new_tokens": 8}, "rid": f"r{t}"} for t, ids in enumerate(sent)]


def test_one_connection_timer_keeps_every_calls_own_timeouts():
    """A connection keeps one timer across its calls (engines/http_transport.py): a later call
    with a shorter read timeout still times out on time; an idle connection whose timer fires
    is not hurt by it; a reply that drips within the read timeout still ends at the call's
    total deadline, which counts from before the request went out."""
    n = 0

    async def script(reader, writer):
        nonlocal n
        async for _ in _requests(reader):
            n += 1
            if n == 2:  # silent for longer than the second call's read timeout
                await asyncio.sleep(1.5)
                return
            if n == 5:  # a byte every 50 ms: each read is in time, the whole reply is not
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n")
                for _ in range(1000):
                    writer.write(b" ")
                    await writer.drain()
                    await asyncio.sleep(0.05)
                return
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()

    async def go():
        server, url, peers = await _raw_server(script)
        loop = asyncio.get_running_loop()
        async with server, httpx.AsyncClient(transport=EngineTransport()) as client:
            t = client._transport

            async def call(read_s: float, total_s: float | None = None) -> bytes:
                reply = await t.open("POST", url + "/g", content=b"{}", headers={}, connect_s=5, read_s=read_s, total_s=total_s)
                try:
                    return await reply.read()
                finally:
                    reply.close()

            assert await call(30) == b"ok"  # arms the connection's timer 30 s out
            t0 = loop.time()
            with pytest.raises(httpx.ReadTimeout, match="read timeout"):
                await call(0.3)  # the same connection: its timer must move up to 0.3 s
            took_read = loop.time() - t0
            assert await call(0.2) == b"ok"  # a new connection; its timer is due in 0.2 s
            await asyncio.sleep(0.4)  # the timer fires on the idle connection
            assert await call(0.2) == b"ok"  # and the connection is still good
            t0 = loop.time()
            with pytest.raises(httpx.ReadTimeout, match="no complete reply within 0.6 s"):
                await call(0.5, total_s=0.6)
            took_total = loop.time() - t0
        return took_read, took_total, peers

    took_read, took_total, peers = asyncio.run(go())
    assert 0.25 < took_read < 1.2, took_read
    assert 0.55 < took_total < 1.5, took_total
    assert len(peers) == 2  # the first connection, dropped at its timeout; the second served the rest
