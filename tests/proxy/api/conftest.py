"""Fixtures for the front-end tests: a scripted turn runner on the real Qwen3 tokenizer,
an in-memory response store, and the dialect routers served by uvicorn on loopback (``agents_server``)."""

from __future__ import annotations

import pytest

from tests.fakes.runner import MemoryStore
from tests.proxy.api.agents_server import serve
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


@pytest.fixture(scope="session")
def server(tok, renderer):
    with serve(tok, renderer) as handle:
        yield handle


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
