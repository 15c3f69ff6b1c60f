"""An ASGI app served by uvicorn in a daemon thread of the test process (real HTTP over
loopback, with the app's objects and the collector's state in reach of the test)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Callable


def serve_in_thread(app, timeout_s: float = 30.0, **config) -> tuple[str, Callable[[], None]]:
    """``(base_url, stop)``; ``config`` goes to ``uvicorn.Config``. The socket is bound before the
    thread starts: no port race."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the app did not start serving")
        time.sleep(0.02)

    def stop() -> None:
        server.should_exit = True
        thread.join(15)
        sock.close()

    return f"http://127.0.0.1:{sock.getsockname()[1]}", stop
