"""A real uvicorn server with Splice's protocol (``proxy.http_server.server_options``) on
127.0.0.1 in a daemon thread, for tests of the HTTP layer below the app."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from proxy.http_server import server_options


def serve(app) -> tuple[uvicorn.Server, int]:
    """Start ``app`` and return the server (set ``should_exit`` to stop it) and its port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(app, host="127.0.0.1", port=port, loop="asyncio", log_level="warning", **server_options(65536, 10.0, 5.0))
    server = uvicorn.Server(config)
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    return server, port
