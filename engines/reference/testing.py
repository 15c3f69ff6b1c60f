"""Reference engines for tests: ``start_engine`` (a real subprocess, from ``launch``) or
``start_engine_in_thread`` (the same app inside the test process: faster to start)."""

from __future__ import annotations

import os
import socket
import threading
from typing import Callable

from .launch import free_port, start_engine, wait_healthy

__all__ = ["free_port", "start_engine", "start_engine_in_thread", "wait_healthy"]


def start_engine_in_thread(model_dir: str | os.PathLike, **create_app_kw) -> tuple[str, Callable[[], None]]:
    """Serve ``create_app(model_dir, **create_app_kw)`` with uvicorn in a daemon thread.

    Returns ``(base_url, stop)``. The socket is bound before the thread starts, so there is
    no port race.
    """
    import uvicorn

    from .server import create_app

    app = create_app(model_dir, **create_app_kw)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="reference-engine-http", daemon=True)
    thread.start()
    wait_healthy(url, 60.0, alive=thread.is_alive)

    def stop() -> None:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()

    return url, stop
