"""A Splice fleet end to end (docs/fleet.md): three ``splice serve`` proxies sharing two reference
engines, publishes landing while generations are in flight on every proxy.

- each engine loads each version exactly once (the reference engine counts its loads);
- every recorded token's version is the version of the weights that sampled it, and its
  proximal value is log pi_{v+1} (checked against an independent transformers forward pass of
  each version's weights);
- ``splice train``'s trainer pulls the samples of all proxies and publishes v+1 the same way;
- a proxy whose resume is delayed stamps nothing wrong;
- a proxy that was down across updates catches up from its engines; its tokens whose v+1 came
  and went stay marked as missing.
"""

from __future__ import annotations

import threading
import time
import uuid

import httpx
import pytest

from tests.e2e.conftest import kill_tree, start_proxy
from trainer_bridge.publish import publish

pytestmark = pytest.mark.slow

LONG = (
    "The quick brown fox jumps over the lazy dog while the patient cat watches from the warm windowsill, "
    "counting birds that fly past the old oak tree in the garden behind the house; meanwhile the farmer "
    "walks to the barn and feeds the horses."
)
DELAY_S = 0.03
N_VERSIONS = 7


@pytest.fixture(scope="module")
def weights(tmp_path_factory, model_dir):
    from engines.reference.model_init import perturb_model

    root = tmp_path_factory.mktemp("fleet-weights")
    paths = {0: model_dir}
    for v in range(1, N_VERSIONS + 1):
        paths[v] = str(perturb_model(model_dir, root / f"v{v}", seed=100 + v, scale=0.05))
    return paths


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, model_dir):
    from engines.reference.launch import start_engine

    engines = []
    started = []
    try:
        for _ in range(2):
            url, stop = start_engine(model_dir, script=[LONG + "<|im_end|>"], script_delay_s=DELAY_S, timeout_s=120)
            engines.append((url, stop))
        extra = [a for url, _ in engines for a in ("--engine-url", url)]
        tmp = tmp_path_factory.mktemp("fleet")
        boxes: list = [None] * 3

        def start(i: int) -> None:
            boxes[i] = start_proxy(tmp, model_dir, extra=extra, store=str(tmp / f"proxy{i}.sqlite"))

        threads = [threading.Thread(target=start, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        started = [p for p in boxes if p is not None]
        assert len(started) == 3, "a proxy did not start"
        yield {"engines": [u for u, _ in engines], "proxies": started, "tmp": tmp, "extra": extra}
    finally:
        for p in started:
            kill_tree(p)
        for _, stop in engines:
            stop()


# -- helpers -------------------------------------------------------------------------------------

_MODELS: dict[str, object] = {}


def _forward(path: str, ids: list[int], start: int) -> list[float]:
    """log pi(ids[i] | ids[:i]) for i >= start, from a plain transformers forward pass."""
    import torch
    from transformers import AutoModelForCausalLM

    if path not in _MODELS:
        _MODELS[path] = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = _MODELS[path](torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [float(lp[i - 1, ids[i]]) for i in range(start, len(ids))]


class Agent(threading.Thread):
    """One streamed chat turn against a proxy; ``tokens`` counts content chunks seen."""

    def __init__(self, proxy, sid: str, *, group: str | None = None, size: int | None = None):
        super().__init__(daemon=True)
        self.proxy, self.sid = proxy, sid
        self.headers = {"X-Session-Id": sid}
        if group:
            self.headers.update({"X-Group-Id": group, "X-Group-Size": str(size)})
        self.tokens = 0
        self.result: dict = {}

    def run(self) -> None:
        try:
            with httpx.stream(
                "POST", self.proxy.url + "/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": f"Tell me a story ({self.sid})."}], "stream": True},
                headers=self.headers, timeout=180,
            ) as r:
                self.result["status"] = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: ") and '"content"' in line:
                        self.tokens += 1
                    if line == "data: [DONE]":
                        self.result["done"] = True
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.result["error"] = repr(exc)


def _wait(cond, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _loads(engine: str) -> tuple[int, list]:
    info = httpx.get(engine + "/model_info", timeout=30).json()
    return info["weight_loads"], info["weight_load_versions"]


def _check_turn(turn: dict, weights: dict[int, str], *, missing_ok: bool = False) -> set[int]:
    """Every token's behaviour logprob is its stamped version's; every proximal value is v+1's
    (or, where v+1 never reached the proxy, equal to the behaviour value with the same version)."""
    prompt, out = turn["prompt_ids"], turn["output_ids"]
    versions, behav = turn["versions"], turn["output_logprobs"]
    prox, pvers = turn["proximal_logprobs_t"], turn["proximal_versions"]
    ids = prompt + out
    for v in sorted(set(versions)):
        ref = _forward(weights[v], ids, len(prompt))
        idx = [i for i, x in enumerate(versions) if x == v]
        assert [behav[i] for i in idx] == pytest.approx([ref[i] for i in idx], abs=2e-3), f"tokens stamped v{v}"
    for v in sorted({pv for pv, x in zip(pvers, versions) if pv == x + 1}):
        ref = _forward(weights[v], ids, len(prompt))
        idx = [i for i, (pv, x) in enumerate(zip(pvers, versions)) if pv == v and x == v - 1]
        assert [prox[i] for i in idx] == pytest.approx([ref[i] for i in idx], abs=2e-4), f"proximal under v{v}"
    for i, (pv, x) in enumerate(zip(pvers, versions)):
        assert pv in (x, x + 1)
        if pv == x:
            assert prox[i] == behav[i]
    return set(versions)


# -- the tests -----------------------------------------------------------------------------------


def test_three_proxies_two_engines_three_publishes_in_flight_then_train(fleet, weights, tmp_path_factory):
    proxies, engines = fleet["proxies"], fleet["engines"]
    urls = [p.url for p in proxies]
    statuses = [p.get("/admin/status").json() for p in proxies]
    ids = {r["id"] for s in statuses for r in s["engines"]["engine_replicas"]}
    assert len(ids) == 2  # three proxies, two distinct engines

    agents = []
    for k, p in enumerate(proxies):
        for j in range(2):
            agents.append(Agent(p, f"fleet-{k}-{j}-{uuid.uuid4().hex[:6]}", group=f"g{k}", size=2))
    for a in agents:
        a.start()
    _wait(lambda: all(a.tokens >= 3 or a.result for a in agents))

    reports = []
    for v in (1, 2, 3):
        reports.append(publish(urls, weights[v], v))
        time.sleep(0.4)  # let every generation sample some tokens under v
    for a in agents:
        a.join(120)
        assert a.result.get("status") == 200 and a.result.get("done"), a.result

    for r in reports:
        assert r.ok and sorted(r.loaded) == sorted(ids) and r.skipped == [] and len(set(r.loaders.values())) == 2
    for e in engines:
        assert _loads(e) == (3, ["1", "2", "3"])  # each engine loaded each version exactly once
    assert {p.get("/admin/status").json()["version"] for p in proxies} == {3}

    seen: set[int] = set()
    for a in agents:
        (turn,) = a.proxy.get(f"/v1/sessions/{a.sid}").json()["turns"]
        assert turn["finish_reason"] == "stop"
        seen |= _check_turn(turn, weights)
    assert seen == {0, 1, 2, 3}

    # re-running the same publish is a no-op for the engines
    again = publish(urls, weights[3], 3)
    assert again.loaded == [] and sorted(again.skipped) == sorted(ids)
    assert all(_loads(e)[0] == 3 for e in engines)

    for a in agents:
        assert a.proxy.post(f"/v1/sessions/{a.sid}/reward", {"reward": float(hash(a.sid) % 2)}).status_code == 200

    from trainer_bridge.config import TrainConfig
    from trainer_bridge.train import train

    # the step's weights outlive this test: the later tests publish them again (``weights[4]``)
    train_dir = tmp_path_factory.mktemp("fleet-train")
    stats = train(TrainConfig(proxies=urls, model=weights[3], out=str(train_dir), steps=1, batch_samples=6,
                              min_samples=6, lr=1e-2, pull_wait_s=5, pull_timeout_s=60, progress=False, max_staleness=None))
    assert len(stats) == 1 and stats[0]["version"] == 4 and stats[0]["n_samples"] == 6
    weights[4] = stats[0]["model_path"]  # v4 is the trainer's own step
    assert {p.get("/admin/status").json()["version"] for p in proxies} == {4}
    for e in engines:
        assert _loads(e)[0] == 4  # the trainer's publish loaded each engine once too
    for p in proxies:  # every proxy's samples were pulled and acked
        assert p.post("/v1/trajectories/pull", {"max_samples": 10, "wait_s": 0}).json()["samples"] == []


def test_a_delayed_resume_stamps_no_token_with_the_wrong_version(fleet, weights):
    proxies, engines = fleet["proxies"], fleet["engines"]
    urls = [p.url for p in proxies]
    v = max(p.get("/admin/status").json()["version"] for p in proxies) + 1
    agents = [Agent(p, f"late-{k}-{uuid.uuid4().hex[:6]}") for k, p in enumerate(proxies)]
    for a in agents:
        a.start()
    _wait(lambda: all(a.tokens >= 3 or a.result for a in agents))

    def slow(url: str) -> None:
        if url == urls[2]:
            time.sleep(1.5)  # the others resume the engines while this proxy still holds its requests

    t0 = time.monotonic()
    report = publish(urls, weights[v], v, before_resume=slow)
    assert report.ok and time.monotonic() - t0 >= 1.5
    for a in agents:
        a.join(120)
        assert a.result.get("done"), a.result
    for a in agents:
        (turn,) = a.proxy.get(f"/v1/sessions/{a.sid}").json()["turns"]
        assert v in _check_turn(turn, weights)
    for e in engines:
        assert _loads(e)[1][-1] == str(v) and _loads(e)[1].count(str(v)) == 1


def test_a_proxy_down_across_updates_catches_up_from_its_engines(fleet, weights):
    proxies, engines = fleet["proxies"], fleet["engines"]
    late = proxies[2]
    v = late.get("/admin/status").json()["version"]
    sid = f"down-{uuid.uuid4().hex[:6]}"
    a = Agent(late, sid)
    a.start()
    a.join(120)
    assert a.result.get("done"), a.result

    late.stop()
    others = [p.url for p in proxies[:2]]
    publish(others, weights[v + 1], v + 1)
    publish(others, weights[v + 2], v + 2)  # v+1 came and went while the proxy was down
    back = start_proxy(fleet["tmp"], weights[0], extra=fleet["extra"], store=late.store, port=int(late.url.rsplit(":", 1)[1]))
    proxies[2] = back
    status = back.get("/admin/status").json()
    assert status["version"] == v + 2  # learned from the engines, not from its own past

    (turn,) = back.get(f"/v1/sessions/{sid}").json()["turns"]
    assert set(turn["versions"]) == {v}
    assert turn["proximal_versions"] == turn["versions"]  # v+1 never reached this proxy: missing
    assert turn["proximal_logprobs_t"] == turn["output_logprobs"]

    b = Agent(back, f"after-{uuid.uuid4().hex[:6]}")
    b.start()
    b.join(120)
    assert b.result.get("done"), b.result
    (turn,) = back.get(f"/v1/sessions/{b.sid}").json()["turns"]
    assert _check_turn(turn, weights) == {v + 2}
    for e in engines:
        assert _loads(e)[1][-2:] == [str(v + 1), str(v + 2)]  # the restart loaded nothing
