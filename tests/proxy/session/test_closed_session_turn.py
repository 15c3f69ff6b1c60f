"""A turn on a rewarded session is refused with 409 ``session_closed`` before any generation,
also when the session's open state was read (and kept, ``SessionTable.for_turn``) by the turns
before the reward."""

from __future__ import annotations

import asyncio

import httpx
import respx

from engines.pool import EnginePool
from proxy.app import create_app
from proxy.settings import Settings
from tests.fakes.engines import FakeSGLang, Step
from tokenization import ChatFormat, load_tokenizer, qwen3_tokenizer_dir

TOK = load_tokenizer(str(qwen3_tokenizer_dir()))
URL = "http://engine-a:30000"


def test_a_turn_after_the_reward_is_refused_without_generating(tmp_path):
    async def main():
        with respx.mock(assert_all_called=False) as router:
            engine = FakeSGLang(router, URL)
            engine.script = [Step(tokens=[(t, -0.5) for t in TOK.encode("Done.<|im_end|>", add_special_tokens=False)])
                             for _ in range(3)]  # fmt: skip
            app = create_app(Settings(store=str(tmp_path / "s.sqlite"), engine_url=[URL]), fmt=ChatFormat(TOK, "qwen3"),
                             pool=EnginePool("sglang", [URL], health_interval_s=0))  # fmt: skip
            async with app.router.lifespan_context(app):
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as c:
                    msgs = [{"role": "user", "content": "Do the task."}]
                    for _ in range(2):  # the second turn reads the session (open) and keeps it
                        r = await c.post("/v1/chat/completions", json={"messages": msgs}, headers={"X-Session-Id": "s"})
                        assert r.status_code == 200, r.text
                        msgs += [r.json()["choices"][0]["message"], {"role": "user", "content": "Go on."}]
                    assert (await c.post("/v1/sessions/s/reward", json={"reward": 1.0})).status_code == 200
                    r = await c.post("/v1/chat/completions", json={"messages": msgs}, headers={"X-Session-Id": "s"})
            return r, len(engine.requests)

    r, generated = asyncio.run(main())
    assert r.status_code == 409 and r.json()["error"]["code"] == "session_closed", r.text
    assert generated == 2  # refused before the engine was asked
