"""A turn that no other can join commits at once, without waiting a pass of the event loop for
company (proxy/store/group_commit.py, ``now``); turns open together still share a transaction."""

from __future__ import annotations

import asyncio

import httpx
import respx

from engines.pool import EnginePool
from proxy.app import create_app
from proxy.settings import Settings
from tests.fakes.engines import FakeSGLang, Step, until
from tokenization import ChatFormat, load_tokenizer, qwen3_tokenizer_dir

TOK = load_tokenizer(str(qwen3_tokenizer_dir()))
URL = "http://engine-a:30000"
DONE = [(t, -0.5) for t in TOK.encode("Done.<|im_end|>", add_special_tokens=False)]


class GatedSGLang(FakeSGLang):
    """Holds every /generate until ``gate`` opens: the turns are all open when they commit."""

    gate: asyncio.Event | None = None
    arrived = 0

    async def _generate(self, request: httpx.Request) -> httpx.Response:
        self.arrived += 1
        if self.gate is not None:
            await self.gate.wait()
        return await super()._generate(request)


def _run(tmp_path, concurrent: bool) -> tuple[list[bool], list[int], int]:
    async def main():
        with respx.mock(assert_all_called=False) as router:
            engine = GatedSGLang(router, URL)
            engine.script = [Step(tokens=DONE) for _ in range(3)]
            app = create_app(Settings(store=str(tmp_path / "s.sqlite"), engine_url=[URL]), fmt=ChatFormat(TOK, "qwen3"),
                             pool=EnginePool("sglang", [URL], health_interval_s=0))  # fmt: skip
            async with app.router.lifespan_context(app):
                group = app.state.store.turns.group
                nows: list[bool] = []
                groups: list[int] = []
                submit, on_flush = group.submit, group.on_flush

                def spy_submit(work, *, turn=True, now=False):
                    if turn:
                        nows.append(now)
                    return submit(work, turn=turn, now=now)

                def spy_flush(n: int) -> None:
                    groups.append(n)
                    on_flush(n)

                group.submit, group.on_flush = spy_submit, spy_flush
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as c:

                    async def turn(k: int) -> httpx.Response:
                        body = {"messages": [{"role": "user", "content": f"Task {k}."}]}
                        return await c.post("/v1/chat/completions", json=body, headers={"X-Session-Id": f"s{k}"})

                    if concurrent:
                        engine.gate = asyncio.Event()
                        pending = [asyncio.ensure_future(turn(k)) for k in range(3)]
                        await until(lambda: engine.arrived == 3)
                        engine.gate.set()
                        replies = await asyncio.gather(*pending)
                    else:
                        replies = [await turn(k) for k in range(3)]
                assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
                stored = sum(len(app.state.store.turns.list(f"s{k}")) for k in range(3))
            return nows, groups, stored

    return asyncio.run(main())


def test_turns_one_at_a_time_commit_at_once_each_in_its_own_transaction(tmp_path):
    nows, groups, stored = _run(tmp_path, concurrent=False)
    assert nows == [True, True, True]
    assert groups == [1, 1, 1] and stored == 3


def test_turns_open_together_wait_for_the_pass_and_share_a_transaction(tmp_path):
    nows, groups, stored = _run(tmp_path, concurrent=True)
    assert nows[0] is False  # two more turns were open when the first committed
    assert sum(groups) == 3 and max(groups) > 1 and stored == 3

