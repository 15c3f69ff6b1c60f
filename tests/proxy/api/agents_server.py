"""A loopback server with all three dialects (Responses, Chat, Messages) over the scripted
runner, for the tests of agent-facing behaviour (Anthropic SDK, Codex-shaped requests)."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

from engines.reference.launch import free_port
from tests.fakes.runner import MemoryStore, ScriptedRunner


def build_app(runner, store, images=None):
    import orjson
    from fastapi import FastAPI
    from fastapi.responses import Response

    from proxy.api.chat import chat_router
    from proxy.api.messages import messages_router
    from proxy.api.responses import responses_router
    from proxy.errors import APIError

    app = FastAPI()
    app.include_router(responses_router(runner, store, images))
    app.include_router(chat_router(runner, images))
    app.include_router(messages_router(runner, images))

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return Response(orjson.dumps(e.body()), status_code=e.status, headers=e.headers, media_type="application/json")

    return app


class Handle:
    def __init__(self, runner, store, base_url):
        self.runner, self.store, self.base_url = runner, store, base_url


@contextmanager
def serve(tok, renderer, *, fmt=None, images=None):
    """``fmt``: the runner's chat format (default Qwen3's); ``images``: the app's ``ImageInput``."""
    import uvicorn

    store = MemoryStore()
    runner = ScriptedRunner(tok, renderer, store=store)
    if fmt is not None:
        runner.fmt = fmt
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(build_app(runner, store, images), host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    deadline = time.time() + 20
    while not srv.started:
        if time.time() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        handle = Handle(runner, store, f"http://127.0.0.1:{port}")
        handle.images = images
        yield handle
    finally:
        srv.should_exit = True
        th.join(timeout=10)
