"""Turns record the drift a full re-render would have caused (what splicing avoided).

The reference is the model's own chat template (``apply_chat_template``): a spliced turn
drifted exactly when the template's render of its conversation differs from the prompt the
engine was sent. Qwen3's template drops the reasoning of assistant turns before the last user
message, so every turn spliced after a new user message drifts. The parent's check writes its flag after the fact;
a child of a drifted turn is committed with it.
"""

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
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}]
REPLY = "<think>\nThe user wants the next step.\n</think>\n\nStep done.<|im_end|>"


def _step() -> Step:
    return Step(tokens=[(t, -0.25) for t in TOK.encode(REPLY, add_special_tokens=False)])


def test_spliced_turns_record_the_drift_the_template_would_have_caused(tmp_path):
    async def main():
        with respx.mock(assert_all_called=False) as router:
            engine = FakeSGLang(router, URL)
            engine.script = [_step() for _ in range(4)]
            app = create_app(Settings(store=str(tmp_path / "s.sqlite"), engine_url=[URL]), fmt=ChatFormat(TOK, "qwen3"),
                             pool=EnginePool("sglang", [URL], health_interval_s=0))  # fmt: skip
            convs, writes = [], []
            set_drift = app.state.store.turns.set_drift_grouped
            app.state.store.turns.set_drift_grouped = lambda *a, **k: (writes.append(a), set_drift(*a, **k))[1]
            async with app.router.lifespan_context(app):
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as c:
                    msgs = [{"role": "user", "content": "Run f until done."}]
                    for k in range(4):
                        r = await c.post("/v1/chat/completions", json={"messages": msgs, "tools": TOOLS}, headers={"X-Session-Id": "d"})
                        assert r.status_code == 200, r.text
                        convs.append([dict(m) for m in msgs])
                        m = r.json()["choices"][0]["message"]
                        msgs += [{"role": "assistant", "content": m["content"], "reasoning_content": m["reasoning_content"]},
                                 {"role": "user", "content": f"Now step {k + 1}."}]  # fmt: skip
                        await app.state.runner.drain()  # the parent's check is done before the child commits
                turns = app.state.store.turns.list("d")
                drift_metric = app.state.metrics.drift._value.get()
            return engine, convs, turns, drift_metric, writes

    engine, convs, turns, drift_metric, writes = asyncio.run(main())
    sent = [req["input_ids"] for req in engine.requests]
    expected = []
    for conv, prompt in zip(convs, sent):
        full = TOK.apply_chat_template(conv, tools=TOOLS, add_generation_prompt=True, tokenize=True)
        full = list(full["input_ids"] if isinstance(full, dict) or hasattr(full, "keys") else full)
        expected.append(full != prompt)
    assert [t.spliced for t in turns] == [False, True, True, True]
    assert expected == [False, True, True, True]  # earlier reasoning dropped: every spliced turn drifts
    assert [t.drift for t in turns] == expected
    assert drift_metric == sum(expected)
    assert [w[0] for w in writes] == [turns[1].turn_id]  # turns 2 and 3 were committed with it: no second write


def test_sampled_checks_spend_a_token_budget_so_long_sessions_stay_cheap():
    """Each spliced turn earns TOKENS_PER_TURN tokens of re-rendering; a due check spends its
    prompt's length. A long session is checked as often as the budget allows, not at every
    power of two."""
    from types import SimpleNamespace

    from proxy.session import drift as d

    rendered = []

    class Fmt:
        def render(self, messages, tools, template_kwargs=None):
            rendered.append(len(messages))
            return list(messages)  # the prompt below equals it: no drift

    class Metrics:
        drift = SimpleNamespace(inc=lambda: None)

    checker = d.DriftChecker(Fmt(), store=None, metrics=Metrics(), mode="sampled")

    def turn(i: int, n: int):
        ids = list(range(n))
        req = SimpleNamespace(messages=ids, tools=None, chat_template_kwargs=None)
        return req, SimpleNamespace(index=i, prompt_ids=ids, turn_id=f"t{n}-{i}")

    async def session(n: int, turns: int):
        for i in range(1, turns):
            work = checker.note(*turn(i, n), parent_turn_id=None)
            if work is not None:  # a render in a thread, as the runner's background task runs it
                await work

    asyncio.run(session(300, 9))  # short turns: every due turn (1, 2, 4, 8) is checked
    assert rendered == [300] * 4 and checker.skipped == 0
    rendered.clear()
    n = 20_000
    asyncio.run(session(n, 65))  # 64 spliced turns: what they earn plus the start pays for this many checks at most
    assert 1 <= len(rendered) <= (d.START_BUDGET + 64 * d.TOKENS_PER_TURN) // n < 7
    assert checker.skipped == 7 - len(rendered)  # due: 1, 2, 4, 8, 16, 32, 64
