"""Header-less sessions stay apart when their histories coincide (a GRPO group whose sessions
all sampled the same first answer): every second turn lands in a distinct session, each
session's sample is one whole episode, and a reward posted to the session a response names
(``X-Splice-Session-Id``) trains that episode."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.e2e.conftest import kill_tree, start_proxy

pytestmark = pytest.mark.slow

ANSWER = "The answer is 42."


@pytest.fixture(scope="module")
def proxy(tmp_path_factory, model_dir):
    p = start_proxy(tmp_path_factory.mktemp("headerless"), model_dir, script=[ANSWER + "<|im_end|>"])
    yield p
    kill_tree(p)


async def _post(client: httpx.AsyncClient, path: str, body: dict) -> httpx.Response:
    r = await client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r


async def _chat_group(url: str, n: int, tag: str) -> list[tuple[str, str, float]]:
    question = [{"role": "user", "content": f"What is six times seven? ({tag})"}]
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        firsts = [await _post(c, "/v1/chat/completions", {"model": "m", "messages": question}) for _ in range(n)]
        assert {r.json()["choices"][0]["message"]["content"] for r in firsts} == {ANSWER}
        follow = question + [{"role": "assistant", "content": ANSWER}, {"role": "user", "content": "Are you sure?"}]
        seconds = await asyncio.gather(*(_post(c, "/v1/chat/completions", {"model": "m", "messages": follow}) for _ in range(n)))
    return [(f.headers["x-splice-session-id"], s.headers["x-splice-session-id"], s.json()["splice"]["spliced"]) for f, s in zip(firsts, seconds)]


async def _responses_group(url: str, n: int, tag: str) -> list[tuple[str, str, float]]:
    """Responses clients replay the output items (with their ids), as the openai SDK's users do."""
    question = [{"role": "user", "content": f"What is six times seven? ({tag})"}]
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        firsts = [await _post(c, "/v1/responses", {"model": "m", "input": question}) for _ in range(n)]
        follows = [question + r.json()["output"] + [{"role": "user", "content": "Are you sure?"}] for r in firsts]
        seconds = await asyncio.gather(*(_post(c, "/v1/responses", {"model": "m", "input": f}) for f in follows))
    return [(f.json()["splice"]["session_id"], s.json()["splice"]["session_id"], s.json()["splice"]["spliced"]) for f, s in zip(firsts, seconds)]


@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("n", [2, 8])
def test_identical_first_turns_continue_in_distinct_sessions(proxy, api, n):
    run = _chat_group if api == "chat" else _responses_group
    pairs = asyncio.run(run(proxy.url, n, f"{api}-{n}"))
    first_sessions = [a for a, _, _ in pairs]
    second_sessions = [b for _, b, _ in pairs]
    assert len(set(first_sessions)) == n
    assert sorted(second_sessions) == sorted(first_sessions)  # a bijection: no session got two continuations
    assert all(spliced for _, _, spliced in pairs)
    if api == "responses":  # the replayed ids name the turn: each client stays in its own session
        assert second_sessions == first_sessions

    # each client rewards the session its second response named; samples are whole episodes
    rewards = {sid: float(k) for k, sid in enumerate(second_sessions)}
    for sid, reward in rewards.items():
        assert proxy.post(f"/v1/sessions/{sid}/reward", {"reward": reward}).status_code == 200
    for sid in rewards:
        turns = proxy.get(f"/v1/sessions/{sid}").json()["turns"]
        assert len(turns) == 2 and turns[1]["parent_turn_id"] == turns[0]["turn_id"] and turns[1]["spliced"]
    pulled = proxy.post("/v1/trajectories/pull", {"max_samples": 100}).json()
    mine = [s for s in pulled["samples"] if s["session_id"] in rewards]
    assert len(mine) == n  # one sample per session: both turns in it
    for s in mine:
        assert s["reward"] == rewards[s["session_id"]]
        assert len(s["turn_ids"]) == 2
    assert proxy.post("/v1/trajectories/ack", {"lease_id": pulled["lease_id"]}).status_code == 200
