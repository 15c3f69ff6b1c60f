"""A response's head and body go out in one write (proxy/http_server.py, ``OneSend``), over a
real uvicorn server on 127.0.0.1 with Splice's protocol; a stream's head still goes out before
its first event is ready."""

from __future__ import annotations

import asyncio
import socket
import time
from asyncio import selector_events

from proxy.http_server import server_options
from tests.fakes.serve import serve_in_thread

WRITES: list[bytes] = []


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    if scope["path"] == "/json":
        body = b'{"ok":true}'
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    await asyncio.sleep(0.5)  # the first event is not ready yet
    await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
    await send({"type": "http.response.body", "body": b""})


def _serve(monkeypatch):
    real = selector_events._SelectorSocketTransport.write

    def write(self, data):
        WRITES.append(bytes(data))
        return real(self, data)

    monkeypatch.setattr(selector_events._SelectorSocketTransport, "write", write)
    url, stop = serve_in_thread(app, loop="asyncio", **server_options(65536, 10.0, 5.0))
    return stop, int(url.rsplit(":", 1)[1])


def _read_until(sock: socket.socket, marker: bytes, timeout: float) -> bytes:
    sock.settimeout(timeout)
    got = b""
    while marker not in got:
        chunk = sock.recv(65536)
        if not chunk:
            break
        got += chunk
    return got


def test_a_json_answer_is_one_write_and_a_stream_head_is_not_held(monkeypatch):
    stop, port = _serve(monkeypatch)
    try:
        with socket.create_connection(("127.0.0.1", port)) as c:
            for _ in range(2):  # keep-alive: the second answer on the same connection too
                WRITES.clear()
                c.sendall(b"POST /json HTTP/1.1\r\nhost: t\r\ncontent-length: 2\r\n\r\n{}")
                got = _read_until(c, b'{"ok":true}', 5)
                assert got.startswith(b"HTTP/1.1 200 OK\r\n") and got.endswith(b'\r\n\r\n{"ok":true}')
                assert WRITES == [got]  # head and body in one write
            WRITES.clear()
            t0 = time.monotonic()
            c.sendall(b"GET /stream HTTP/1.1\r\nhost: t\r\n\r\n")
            head = _read_until(c, b"\r\n\r\n", 5)
            assert head.startswith(b"HTTP/1.1 200 OK\r\n") and time.monotonic() - t0 < 0.4  # before the event
            rest = _read_until(c, b"0\r\n\r\n", 5)
            assert b"data: 1\n\n" in head + rest
            assert len(WRITES) == 3 and WRITES[0] == head  # the head alone, then the event, then the end
    finally:
        stop()
