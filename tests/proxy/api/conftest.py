"""Fixtures for the front-end tests: a scripted turn runner on the real Qwen3 tokenizer,
an in-memory response store, and the two routers served by uvicorn on loopback."""

from __future__ import annotations

import threading
import time

import pytest

from engines.reference.launch import free_port
from tests.fakes.runner import MemoryStore, ScriptedRunner
from tokenization.loader import load_tokenizer, make_renderer, qwen3_tokenizer_dir


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="session")
def tok():
    return load_tokenizer(str(qwen3_tokenizer_dir()))


@pytest.fixture(scope="session")
def renderer(tok):
    return make_renderer(tok, "qwen3")


@pytest.fixture
def mem_store():
    return MemoryStore()


def build_app(runner, store):
    import orjson
    from fastapi import FastAPI
    from fastapi.responses import Response

    from proxy.api.chat import chat_router
    from proxy.api.responses import responses_router
    from proxy.errors import APIError

    app = FastAPI()
    app.include_router(responses_router(runner, store))
    app.include_router(chat_router(runner))

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return Response(orjson.dumps(e.body()), status_code=e.status, headers=e.headers, media_type="application/json")

    return app


@pytest.fixture(scope="session")
def server(tok, renderer):
    import uvicorn

    store = MemoryStore()
    runner = ScriptedRunner(tok, renderer, store=store)
    app = build_app(runner, store)
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    srv = uvicorn.Server(config)
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    deadline = time.time() + 20
    while not srv.started:
        if time.time() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)

    class Handle:
        pass

    h = Handle()
    h.runner, h.store, h.base_url = runner, store, f"http://127.0.0.1:{port}"
    yield h
    srv.should_exit = True
    th.join(timeout=10)


@pytest.fixture
def live(server):
    server.runner.reset()
    return server


@pytest.fixture
def client(live):
    from openai import OpenAI

    c = OpenAI(base_url=live.base_url + "/v1", api_key="test", max_retries=0, timeout=30)
    yield c
    c.close()


@pytest.fixture
async def aclient(live):
    from openai import AsyncOpenAI

    c = AsyncOpenAI(base_url=live.base_url + "/v1", api_key="test", max_retries=0, timeout=30)
    yield c
    await c.close()  # in the test's own event loop
