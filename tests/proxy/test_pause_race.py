"""A pause never outlives the trainer that asked for it, and held agent turns never wait forever.

Real parts: the reference engine over HTTP behind the real ``EnginePool``, the proxy app served
by uvicorn on loopback (so a client that gives up really disconnects). The one test hook: a
pool whose pause takes a second and a half, standing in for the owed recomputes a pause runs
first (which is what made trainers time out in the field).
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from engines.pool import EnginePool
from tests.fakes.serve import serve_in_thread

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


class SlowPausePool(EnginePool):
    pause_delay_s = 1.5

    async def pause(self) -> None:
        import asyncio

        await asyncio.sleep(self.pause_delay_s)
        await super().pause()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from engines.reference.model_init import init_model
    from engines.reference.testing import start_engine_in_thread

    model = init_model(tmp_path_factory.mktemp("pause") / "model", max_position_embeddings=4096)
    url, stop = start_engine_in_thread(model, script=["fine.<|im_end|>"] * 50, script_delay_s=0.01)
    yield model, url
    stop()


def _serve(tmp_path, engine, **settings_kw):
    from proxy.app import create_app
    from proxy.settings import Settings
    from tokenization import ChatFormat, load_tokenizer

    model, url = engine
    app = create_app(Settings(store=str(tmp_path / "s.sqlite"), **settings_kw), fmt=ChatFormat(load_tokenizer(str(model)), "qwen3"),
                     pool=SlowPausePool("sglang", [url], health_interval_s=0))  # fmt: skip
    return serve_in_thread(app)


def _status(base):
    return httpx.get(base + "/admin/status", timeout=10).json()


def test_a_pause_whose_caller_gave_up_does_not_pause(tmp_path, engine):
    base, stop = _serve(tmp_path, engine)
    try:
        assert httpx.post(base + "/v1/chat/completions", json=CHAT, timeout=60).status_code == 200
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(base + "/admin/pause", timeout=httpx.Timeout(10, read=0.3))  # the trainer gives up
        assert httpx.post(base + "/admin/resume", timeout=10).json()["paused"] is False  # ... and resumes
        time.sleep(SlowPausePool.pause_delay_s + 0.5)  # the abandoned pause has run its course
        assert _status(base)["paused"] is False
        r = httpx.post(base + "/v1/chat/completions", json=CHAT, timeout=30)  # agents are not held
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "fine."
        # a pause whose caller waits still pauses, and resume lifts it
        assert httpx.post(base + "/admin/pause", timeout=30).json()["paused"] is True
        assert _status(base)["paused"] is True
        httpx.post(base + "/admin/resume", timeout=10)
        assert _status(base)["paused"] is False
    finally:
        stop()


def test_a_pause_nobody_resumes_is_lifted_and_held_turns_go_on(tmp_path, engine):
    base, stop = _serve(tmp_path, engine, max_pause_s=2.0)
    try:
        assert httpx.post(base + "/admin/pause", timeout=30).json()["paused"] is True
        result = {}

        def turn():
            result["r"] = httpx.post(base + "/v1/chat/completions", json=CHAT, timeout=60)

        th = threading.Thread(target=turn)
        th.start()
        time.sleep(0.5)
        assert th.is_alive() and _status(base)["paused"] is True  # held while paused
        th.join(30)
        assert not th.is_alive() and result["r"].status_code == 200
        status = _status(base)
        assert status["paused"] is False and status["expired_pauses"] == 1
    finally:
        stop()
