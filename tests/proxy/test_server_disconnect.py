"""Splice's server protocol tells the app when a client goes away before its answer is complete
(proxy/http_server.py, ``Disconnect`` in ``scope["extensions"]``), over a real uvicorn server on
127.0.0.1: a client that closes mid-request fires it, one that got its whole answer does not,
and a callback added after the client left runs at once."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

from proxy.http_server import DISCONNECT, server_options
from tests.fakes.serve import serve_in_thread

EVENTS: list[str] = []
STARTED = threading.Event()


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    hook = scope["extensions"][DISCONNECT]
    path = scope["path"]
    hook.add(lambda: EVENTS.append(f"gone {path}"))
    if path == "/slow":
        STARTED.set()
        for _ in range(200):  # the client leaves meanwhile
            if hook.gone:
                break
            await asyncio.sleep(0.01)
        hook.add(lambda: EVENTS.append("late callback"))  # added once gone: runs at once
    body = b'{"ok":true}'
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


def _request(path: str) -> bytes:
    return b"POST %s HTTP/1.1\r\nhost: t\r\ncontent-length: 2\r\n\r\n{}" % path.encode()


def _wait(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def test_the_app_hears_of_a_client_gone_mid_request_and_not_of_one_answered():
    url, stop = serve_in_thread(app, **server_options(65536, 10.0, 5.0))
    port = int(url.rsplit(":", 1)[1])
    try:
        with socket.create_connection(("127.0.0.1", port)) as c:  # answered, then closed
            c.sendall(_request("/fast"))
            c.settimeout(5)
            assert b'{"ok":true}' in c.recv(65536)
        with socket.create_connection(("127.0.0.1", port)) as c:  # closed before its answer
            c.sendall(_request("/slow"))
            assert STARTED.wait(5)
        assert _wait(lambda: "late callback" in EVENTS)
        time.sleep(0.1)
        assert EVENTS == ["gone /slow", "late callback"]
    finally:
        stop()
