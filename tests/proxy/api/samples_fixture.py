"""A store with three rewarded samples (a splice, a fork, a recompute, a group) served over real
HTTP by the training routes, and the samples' expected values written out by hand from the turns
(docs/design.md sections 2 and 5). Shared by the pull-format and export tests."""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest

from engines.reference.launch import free_port
from proxy.store import Store
from proxy.store.records import TurnRecord

SCHEMA = json.loads((Path(__file__).parents[3] / "proxy" / "schemas" / "sample.schema.json").read_text())
LEASE_S = 60.0


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _turn(sid, index, prompt, output, logprobs, versions, *, fork_reason=None, sampling=None) -> TurnRecord:
    return TurnRecord(
        turn_id=f"{sid}-t{index}", session_id=sid, index=index, parent_turn_id=None, prompt_ids=prompt,
        output_ids=output, output_logprobs=logprobs, versions=versions, proximal_logprobs_t=list(logprobs),
        proximal_versions=list(versions), spliced=index > 0 and fork_reason is None, fork_reason=fork_reason,
        finish_reason="stop" if index else "length", created_at=500.0 + index,
        requested_sampling=sampling or {"used": {"temperature": 1.0, "top_p": 1.0, "top_k": -1}, "model": "m",
                                        "engine_id": "http://127.0.0.1:30000", "trainable": True},
        drift=False, api="chat", response_id=f"r-{sid}-{index}",
    )  # fmt: skip


@contextmanager
def serve(store: Store):
    import uvicorn
    from fastapi import FastAPI

    from proxy.api.training import training_router
    from proxy.errors import APIError
    from proxy.api.jsonio import JSONResponse
    from proxy.metrics import Metrics
    from proxy.session import RecomputeScheduler

    engines = SimpleNamespace(paused=False, version=0)  # version 0: no token is owed a recompute
    app = FastAPI()
    app.include_router(training_router(store, RecomputeScheduler(store, engines, Metrics()), SimpleNamespace(lease_timeout_s=LEASE_S)))

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    deadline = time.time() + 20
    while not srv.started:
        assert time.time() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        th.join(timeout=10)


@pytest.fixture
def proxy(tmp_path):
    clock = Clock()
    store = Store(str(tmp_path / "s.db"), clock=clock)
    # session a: turn 1 splices onto turn 0 (tool result 50, 51 in between); turn 2 forks.
    store.sessions.upsert("a", group_id="g", group_size=2)
    store.turns.add(_turn("a", 0, [1, 2, 3], [10, 11], [-0.5, -1.25], [4, 4]))
    store.turns.add(_turn("a", 1, [1, 2, 3, 10, 11, 50, 51], [12, 13, 14], [-0.75, -2.5, -0.125], [4, 5, 5]))
    store.turns.add(_turn("a", 2, [1, 9, 3], [15], [-3.0], [5], fork_reason="history_edited",
                          sampling={"used": {"temperature": 0.7, "top_p": 0.9, "top_k": -1}, "trainable": False}))
    store.turns.update_proximal("a-t0", [-0.375, -1.0], [5, 5])  # both tokens recomputed under v5
    store.sessions.upsert("b", group_id="g", group_size=2)
    store.turns.add(_turn("b", 0, [7, 8], [20, 21, 22], [-0.25, -0.5, -1.5], [5, 5, 5]))
    clock.t = 1001.0
    store.sessions.set_reward("a", 1.0)
    clock.t = 1002.0
    store.sessions.set_reward("b", -0.5)
    with serve(store) as url:
        yield SimpleNamespace(url=url, store=store, clock=clock)
    store.close()


EXPECTED = {
    "a:0": dict(
        input_ids=[1, 2, 3, 10, 11, 50, 51, 12, 13, 14],
        loss_mask=[0, 0, 0, 1, 1, 0, 0, 1, 1, 1],
        logprobs=[0, 0, 0, -0.5, -1.25, 0, 0, -0.75, -2.5, -0.125],
        versions=[-1, -1, -1, 4, 4, -1, -1, 4, 5, 5],
        proximal_logprobs_t=[0, 0, 0, -0.375, -1.0, 0, 0, -0.75, -2.5, -0.125],
        proximal_versions=[-1, -1, -1, 5, 5, -1, -1, 4, 5, 5],
        turns=[(0, 0, 3, 2, "length", None, 1.0, 1.0, -1), (1, 5, 7, 3, "stop", None, 1.0, 1.0, -1)],
        reward=1.0, rewarded_at=1001.0, trainable=True,
    ),
    "a:1": dict(
        input_ids=[1, 9, 3, 15], loss_mask=[0, 0, 0, 1], logprobs=[0, 0, 0, -3.0], versions=[-1, -1, -1, 5],
        proximal_logprobs_t=[0, 0, 0, -3.0], proximal_versions=[-1, -1, -1, 5],
        turns=[(2, 0, 3, 1, "stop", "history_edited", 0.7, 0.9, -1)], reward=1.0, rewarded_at=1001.0, trainable=False,
    ),
    "b:0": dict(
        input_ids=[7, 8, 20, 21, 22], loss_mask=[0, 0, 1, 1, 1], logprobs=[0, 0, -0.25, -0.5, -1.5],
        versions=[-1, -1, 5, 5, 5], proximal_logprobs_t=[0, 0, -0.25, -0.5, -1.5], proximal_versions=[-1, -1, 5, 5, 5],
        turns=[(0, 0, 2, 3, "length", None, 1.0, 1.0, -1)], reward=-0.5, rewarded_at=1002.0, trainable=True,
    ),
}
ARRAYS = ("input_ids", "loss_mask", "logprobs", "versions", "proximal_logprobs_t", "proximal_versions")


def check_expected(samples: list[dict]) -> None:
    assert [s["sample_id"] for s in samples] == ["a:0", "a:1", "b:0"]
    for s in samples:
        want = EXPECTED[s["sample_id"]]
        for name in ARRAYS:
            assert list(s[name]) == want[name], (s["sample_id"], name)
        got_turns = [(t["index"], t["context_start"], t["start"], t["length"], t["finish_reason"], t["fork_reason"],
                      t["temperature"], pytest.approx(t["top_p"]), t["top_k"]) for t in s["turns"]]  # fmt: skip
        assert [tuple(x) for x in got_turns] == [tuple(x) for x in want["turns"]]
        assert s["turn_ids"] == [t["turn_id"] for t in s["turns"]]
        assert (s["reward"], s["rewarded_at"], s["trainable"]) == (want["reward"], want["rewarded_at"], want["trainable"])
        assert s["n_tokens"] == len(want["input_ids"]) and s["schema_version"] == 3


