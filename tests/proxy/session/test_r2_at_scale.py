"""R2 at scale (docs/design.md section 4): one prefill per idle session leaf, none for a session
that goes on, a pause that is never blocked.

The whole proxy runs (real Qwen3 tokenizer and chat template, Chat Completions over ASGI) in
front of the strict SGLang / vLLM stand-ins of ``tests.fakes.engines``, whose input logprobs are
an exact function of (weight version, absolute position, token): every stored proximal value is
checked against that function at the token's own position, so a value placed at the wrong
position, taken from the wrong version, or missing shows.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import respx

from engines.pool import EnginePool
from proxy.app import create_app
from proxy.settings import Settings
from tests.fakes.engines import FakeSGLang, FakeVLLM, Step
from tokenization import ChatFormat, load_tokenizer, qwen3_tokenizer_dir

TOK = load_tokenizer(str(qwen3_tokenizer_dir()))
IM_END = TOK.convert_tokens_to_ids("<|im_end|>")
URL = "http://engine-r2:30000"


def exact_lp(version: int, pos: int, token: int) -> float:
    """The stand-ins' log pi_version(token at absolute position pos): distinct per all three."""
    return -round(0.25 + 0.5 * version + pos / 1000.0 + (token % 13) / 10000.0, 7)


def reply_step(n: int) -> Step:
    ids = TOK.encode(f"answer number {n} is here", add_special_tokens=False) + [IM_END]
    return Step(tokens=[(t, -0.1 - 0.01 * i) for i, t in enumerate(ids)], finish="stop", matched=IM_END)


class SGLangR2(FakeSGLang):
    """Answers every turn with a fresh reply; a prefill-only call (``max_new_tokens: 0``) is
    answered from ``exact_lp`` and counted. ``hold_prefills`` makes prefills hang."""

    def __init__(self, router, url):
        super().__init__(router, url)
        self.prefill_lp = exact_lp
        self.prefills: list[dict] = []
        self.turns: list[dict] = []
        self.hold_prefills = False

    async def _generate(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body["sampling_params"]["max_new_tokens"] == 0:
            self.prefills.append(body)
            if self.hold_prefills:
                await asyncio.sleep(3600)
            self.script.insert(0, Step(tokens=[], finish="length"))
        else:
            self.turns.append(body)
            self.script.insert(0, reply_step(len(self.turns)))
        return await FakeSGLang._generate(self, request)


class VLLMR2(FakeVLLM):
    """The vLLM stand-in with the same rules: a prefill is ``echo`` + ``max_tokens: 1``."""

    def __init__(self, router, url):
        super().__init__(router, url, max_model_len=32768)
        self.prefill_lp = exact_lp
        self.prefills: list[dict] = []
        self.turns: list[dict] = []

    async def _complete(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body.get("echo") and body["max_tokens"] == 1:
            self.prefills.append(body)
            self.script.insert(0, Step(tokens=[(7, -1.0)], finish="length"))
        else:
            self.turns.append(body)
            self.script.insert(0, reply_step(len(self.turns)))
        return await FakeVLLM._complete(self, request)


class Harness:
    def __init__(self, app, engine, client: httpx.AsyncClient):
        self.app, self.engine, self.c = app, engine, client
        self.store = app.state.store

    async def turn(self, sid: str, messages: list[dict], *, stream: bool = False) -> str:
        body = {"model": "m", "messages": messages, "stream": stream}
        r = await self.c.post("/v1/chat/completions", json=body, headers={"X-Session-Id": sid})
        assert r.status_code == 200, r.text
        await self.app.state.recompute.flush()  # values a next turn brought are stored after it answers
        if not stream:
            return r.json()["choices"][0]["message"]["content"]
        text = ""
        for line in r.text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for ch in json.loads(line[6:]).get("choices", []):
                    text += ch.get("delta", {}).get("content") or ""
        return text

    async def session(self, sid: str, turns: int, *, stream: bool = False) -> list[dict]:
        msgs = [{"role": "user", "content": f"hello from {sid}"}]
        for k in range(turns):
            content = await self.turn(sid, msgs, stream=stream)
            msgs += [{"role": "assistant", "content": content}, {"role": "user", "content": f"go on {k}"}]
        return msgs

    async def admin(self, path: str, body: dict | None = None) -> dict:
        r = await self.c.post(path, json=body or {})
        assert r.status_code == 200, (path, r.text)
        return r.json()

    async def update(self, version: int) -> dict:
        paused = await self.admin("/admin/pause")
        await self.admin("/admin/update_weights", {"model_path": f"/models/v{version}", "version": version})
        await self.admin("/admin/resume")
        await asyncio.sleep(0.05)  # let background work (closed sessions) run
        return paused

    def check_values(self, sid: str, owed_version: int) -> int:
        """Every token sampled by ``owed_version`` has its exact value under ``owed_version + 1``;
        returns how many tokens were checked."""
        n = 0
        for t in self.store.turns.list(sid):
            for i, (tok, v, pv, prox) in enumerate(zip(t.output_ids, t.versions, t.proximal_versions, t.proximal_logprobs_t)):
                if v != owed_version:
                    continue
                pos = len(t.prompt_ids) + i
                assert pv == owed_version + 1, (sid, t.index, i, t.proximal_versions)
                assert prox == pytest.approx(exact_lp(owed_version + 1, pos, tok), abs=2e-6), (sid, t.index, i)
                n += 1
        return n

    async def metric(self, name: str) -> float:
        text = (await self.c.get("/metrics")).text
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "_total "):
                return float(line.split()[-1])
        raise AssertionError(f"no metric {name}")


def run_with(tmp_path, body, *, kind: str = "sglang", **settings):
    async def main():
        with respx.mock(assert_all_called=False) as router:
            engine = SGLangR2(router, URL) if kind == "sglang" else VLLMR2(router, URL)
            pool = EnginePool(kind, [URL], health_interval_s=0, model="tiny" if kind == "vllm" else "")
            app = create_app(
                Settings(store=str(tmp_path / "s.sqlite"), max_context=4096, drift_check="off", **settings),
                fmt=ChatFormat(TOK, "qwen3"), pool=pool,
            )  # fmt: skip
            async with app.router.lifespan_context(app):
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=30) as c:
                    await body(Harness(app, engine, c))

    asyncio.run(main())


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_idle_sessions_cost_one_prefill_each_at_the_next_pause(tmp_path, kind):
    async def body(h: Harness):
        sids = [f"idle-{i}" for i in range(3)]
        for sid in sids:
            await h.session(sid, 4)
        await h.update(1)
        assert h.engine.prefills == []  # open sessions are not recomputed eagerly
        paused = await h.admin("/admin/pause")  # the deadline: settle before the weights go
        assert len(h.engine.prefills) == 3  # one per session leaf, whatever the number of turns
        assert paused["recompute"]["prefills"] == 3 and paused["recompute"]["missing_tokens"] == 0
        store_turns = {sid: h.store.turns.list(sid) for sid in sids}
        for sid in sids:
            turns = store_turns[sid]
            assert len(turns) == 4 and all(t.spliced for t in turns[1:])
            assert h.check_values(sid, 0) == sum(len(t.output_ids) for t in turns)
        # each prefill is the session's last turn, from its first owed position only
        for req in h.engine.prefills:
            ids = req["input_ids"] if kind == "sglang" else req["prompt"]
            last = next(ts[-1] for ts in store_turns.values() if ts[-1].prompt_ids + ts[-1].output_ids == ids)
            first = next(ts[0] for ts in store_turns.values() if ts[-1] is last)
            if kind == "sglang":
                assert req["logprob_start_len"] == len(first.prompt_ids) - 1
        assert await h.metric("splice_recompute_prefills") == 3
        await h.admin("/admin/resume")
        await h.admin("/admin/pause")  # nothing owed any more: no prefill
        assert len(h.engine.prefills) == 3

    run_with(tmp_path, body, kind=kind)


def test_rollback_gives_two_leaves_both_valued(tmp_path):
    async def body(h: Harness):
        sid = "rb"
        u0 = {"role": "user", "content": "start here"}
        a0 = await h.turn(sid, [u0])
        hist = [u0, {"role": "assistant", "content": a0}]
        a1 = await h.turn(sid, hist + [{"role": "user", "content": "branch one"}])
        await h.turn(sid, hist + [{"role": "user", "content": "branch one"}, {"role": "assistant", "content": a1},
                                  {"role": "user", "content": "deeper"}])  # fmt: skip
        await h.turn(sid, hist + [{"role": "user", "content": "branch two, rolled back"}])  # rollback to turn 0
        turns = h.store.turns.list(sid)
        assert len(turns) == 4 and turns[3].parent_turn_id == turns[0].turn_id
        await h.update(1)
        await h.admin("/admin/pause")
        assert len(h.engine.prefills) == 2  # two leaves: turn 2 (holds 0, 1) and turn 3 (holds 0)
        leaves = sorted(len(r["input_ids"]) for r in h.engine.prefills)
        assert leaves == sorted(len(turns[i].prompt_ids) + len(turns[i].output_ids) for i in (2, 3))
        assert h.check_values(sid, 0) == sum(len(t.output_ids) for t in turns)

    run_with(tmp_path, body)


@pytest.mark.parametrize("stream", [False, True])
def test_next_turn_after_update_fills_every_owed_value_without_a_prefill(tmp_path, stream):
    async def body(h: Harness):
        sid = "goes-on"
        msgs = await h.session(sid, 3, stream=stream)
        before = h.store.turns.list(sid)
        await h.update(1)
        n_turns = len(h.engine.turns)
        content = await h.turn(sid, msgs, stream=stream)  # the next turn, under v1
        assert content == "answer number 4 is here"  # output unchanged
        call = h.engine.turns[n_turns]
        # asks for input logprobs from the first owed position (turn 0's first output token)
        assert call["logprob_start_len"] == len(before[0].prompt_ids) - 1
        assert h.engine.prefills == []
        assert h.check_values(sid, 0) == sum(len(t.output_ids) for t in before)
        assert await h.metric("splice_piggybacked_tokens") == sum(len(t.output_ids) for t in before)
        paused = await h.admin("/admin/pause")  # nothing left for the deadline
        assert h.engine.prefills == [] and paused["recompute"]["prefills"] == 0
        await h.admin("/admin/resume")
        msgs += [{"role": "assistant", "content": content}, {"role": "user", "content": "more"}]
        await h.turn(sid, msgs, stream=stream)
        assert h.engine.turns[-1]["logprob_start_len"] == -1  # owed nothing: no input logprobs asked

    run_with(tmp_path, body)


def test_vllm_next_turn_fills_owed_values_from_prompt_logprobs(tmp_path):
    async def body(h: Harness):
        sid = "v-goes-on"
        msgs = await h.session(sid, 2)
        before = h.store.turns.list(sid)
        await h.update(1)
        await h.turn(sid, msgs)
        assert h.engine.turns[-1].get("echo") is True and h.engine.prefills == []
        assert h.check_values(sid, 0) == sum(len(t.output_ids) for t in before)
        await h.admin("/admin/resume")
        msgs2 = msgs + [{"role": "assistant", "content": "answer number 3 is here"}, {"role": "user", "content": "x"}]
        await h.turn(sid, msgs2)
        assert not h.engine.turns[-1].get("echo")  # owed nothing: prefix cache untouched

    run_with(tmp_path, body, kind="vllm")


def test_back_to_back_updates_settle_the_first_before_the_second_pause(tmp_path):
    async def body(h: Harness):
        for sid in ("b0", "b1"):
            await h.session(sid, 3)
        await h.update(1)
        paused = await h.update(2)  # no turn in between
        assert paused["recompute"]["prefills"] == 2 and paused["recompute"]["missing_tokens"] == 0
        for sid in ("b0", "b1"):
            assert h.check_values(sid, 0) > 0  # under v1, computed before v1's weights went away
        await h.admin("/admin/pause")
        assert len(h.engine.prefills) == 2  # v1 sampled nothing: nothing owed under v2

    run_with(tmp_path, body)


def test_closed_sessions_recomputed_in_background_after_update(tmp_path):
    async def body(h: Harness):
        await h.session("closed", 3)
        await h.session("open", 2)
        assert (await h.c.post("/v1/sessions/closed/reward", json={"reward": 1.0})).status_code == 200
        await h.update(1)
        await h.app.state.runner.drain()
        for _ in range(100):
            if h.engine.prefills:
                break
            await asyncio.sleep(0.01)
        assert len(h.engine.prefills) == 1  # the closed session only; the open one waits
        h.check_values("closed", 0)
        pulled = await h.admin("/v1/trajectories/pull", {"max_samples": 10})
        (sample,) = pulled["samples"]
        assert set(sample["proximal_versions"]) <= {-1, 1} and pulled["dropped_stale"] == 0

    run_with(tmp_path, body)


def test_deadline_passes_values_marked_missing_and_pause_proceeds(tmp_path):
    async def body(h: Harness):
        await h.session("slow", 2)
        owed = sum(len(t.output_ids) for t in h.store.turns.list("slow"))
        await h.update(1)
        h.engine.hold_prefills = True  # the engine never answers the prefill
        t0 = asyncio.get_running_loop().time()
        paused = await h.admin("/admin/pause")
        waited = asyncio.get_running_loop().time() - t0
        assert paused["paused"] is True and paused["recompute"]["timed_out"] is True
        assert waited < 5.0
        assert paused["recompute"]["missing_tokens"] == owed
        assert await h.metric("splice_proximal_missing_tokens") == owed
        await h.admin("/admin/update_weights", {"model_path": "/models/v2", "version": 2})
        await h.admin("/admin/resume")
        for t in h.store.turns.list("slow"):  # missing: proximal == behaviour, same versions
            assert t.proximal_versions == t.versions == [0] * len(t.output_ids)
            assert t.proximal_logprobs_t == t.output_logprobs
        assert h.store.turns.owed_tokens(2) == 0  # and never owed again

    run_with(tmp_path, body, recompute_deadline_s=0.3)


def test_max_staleness_drops_old_samples_at_pull_without_recomputing_them(tmp_path):
    async def body(h: Harness):
        msgs = await h.session("old", 1)
        await h.update(1)
        await h.turn("old", msgs)  # v1 tokens; its v0 tokens get their v1 values from this call
        await h.session("fresh", 1)  # v1 only
        for sid in ("old", "fresh"):
            assert (await h.c.post(f"/v1/sessions/{sid}/reward", json={"reward": 1.0})).status_code == 200
        await h.update(2)  # K=1: v0 tokens are now too old; "old" owes v1 values, "fresh" too
        await h.admin("/admin/pause")
        # only "fresh" is prefilled: "old" holds a v0 loss token, so its sample will be dropped
        assert [r["input_ids"] for r in h.engine.prefills] == [
            t.prompt_ids + t.output_ids for t in h.store.turns.list("fresh")
        ]
        await h.admin("/admin/resume")
        pulled = await h.admin("/v1/trajectories/pull", {"max_samples": 10})
        assert [s["session_id"] for s in pulled["samples"]] == ["fresh"]
        assert pulled["dropped_stale"] == 1
        assert await h.metric("splice_dropped_stale_samples") == 1
        again = await h.admin("/v1/trajectories/pull", {"max_samples": 10})
        assert again["samples"] == [] and again["dropped_stale"] == 0  # dropped from the pool for good

    run_with(tmp_path, body, max_staleness=1)


def test_next_turn_fills_its_branch_and_the_pause_prefills_only_the_other(tmp_path):
    async def body(h: Harness):
        sid = "two-branches"
        u0 = {"role": "user", "content": "start here"}
        a0 = await h.turn(sid, [u0])
        hist = [u0, {"role": "assistant", "content": a0}]
        branch_a = hist + [{"role": "user", "content": "branch a"}]
        a1 = await h.turn(sid, branch_a)
        await h.turn(sid, hist + [{"role": "user", "content": "branch b, rolled back"}])
        turns = h.store.turns.list(sid)
        await h.update(1)
        # the agent goes on along branch a: its call fills turns 0 and 1, not branch b's turn 2
        await h.turn(sid, branch_a + [{"role": "assistant", "content": a1}, {"role": "user", "content": "more a"}])
        assert h.engine.prefills == []
        assert h.engine.turns[-1]["logprob_start_len"] == len(turns[0].prompt_ids) - 1
        await h.turn(sid, branch_a + [{"role": "assistant", "content": a1}, {"role": "user", "content": "more a, again"}])
        assert h.engine.turns[-1]["logprob_start_len"] == -1  # nothing this prompt holds is owed any more
        await h.admin("/admin/pause")
        (prefill,) = h.engine.prefills  # branch b only, from its own first owed token
        assert prefill["input_ids"] == turns[2].prompt_ids + turns[2].output_ids
        assert prefill["logprob_start_len"] == len(turns[2].prompt_ids) - 1
        assert h.check_values(sid, 0) == sum(len(t.output_ids) for t in turns)

    run_with(tmp_path, body)
