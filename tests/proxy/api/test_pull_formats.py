"""The pull over real HTTP in both formats: JSON and the Arrow IPC stream carry identical values,
both validate against the versioned sample schema (proxy/schemas/sample.schema.json), and the
trainer's client reads the Arrow answer into the same values.

The expected arrays are written out by hand from the turns (docs/design.md sections 2 and 5);
Arrow is decoded with pyarrow's own reader, JSON with the standard library.
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pyarrow as pa
import pytest
from jsonschema import Draft202012Validator

from engines.reference.launch import free_port
from proxy.store import Store
from proxy.store.records import TurnRecord
from trainer_bridge.client import ProxyClient

SCHEMA = json.loads((Path(__file__).parents[3] / "proxy" / "schemas" / "sample.schema.json").read_text())
ARROW = "application/vnd.apache.arrow.stream"
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
        assert s["n_tokens"] == len(want["input_ids"]) and s["schema_version"] == 1


def arrow_rows(content: bytes) -> tuple[dict[str, str], list[dict]]:
    reader = pa.ipc.open_stream(content)
    meta = {k.decode(): v.decode() for k, v in reader.schema.metadata.items()}
    table = reader.read_all()
    for name, typ in (("input_ids", pa.int32()), ("versions", pa.int32()), ("proximal_versions", pa.int32()),
                      ("logprobs", pa.float32()), ("proximal_logprobs_t", pa.float32()), ("loss_mask", pa.uint8())):
        assert table.schema.field(name).type == pa.list_(typ), name  # fmt: skip
    return meta, table.to_pylist()


def test_json_and_arrow_carry_identical_values_and_validate(proxy):
    validator = Draft202012Validator(SCHEMA)
    r = httpx.post(proxy.url + "/v1/trajectories/pull", json={"max_samples": 10})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    body = r.json()
    validator.validate(body)
    assert body["schema_version"] == 1 and body["dropped_stale"] == 0 and body["lease_id"].startswith("lease_")
    check_expected(body["samples"])

    proxy.clock.t += LEASE_S + 1  # the JSON lease expires unacked: the same samples come back
    r = httpx.post(proxy.url + "/v1/trajectories/pull", json={"max_samples": 10}, headers={"Accept": ARROW})
    assert r.status_code == 200 and r.headers["content-type"] == ARROW
    meta, rows = arrow_rows(r.content)
    assert meta["splice.schema_version"] == "1" and meta["splice.dropped_stale"] == "0"
    assert meta["splice.lease_id"] == r.headers["x-splice-lease-id"] != body["lease_id"]
    as_json = {"schema_version": int(meta["splice.schema_version"]), "lease_id": meta["splice.lease_id"],
               "samples": rows, "dropped_stale": int(meta["splice.dropped_stale"])}  # fmt: skip
    validator.validate(as_json)
    check_expected(rows)
    for j, a in zip(body["samples"], rows):  # identical values, field by field (float32 both ways)
        assert set(j) == set(a)
        for key in j:
            if key in ("logprobs", "proximal_logprobs_t"):
                assert np.array_equal(np.asarray(j[key], np.float32), np.asarray(a[key], np.float32))
            else:
                assert j[key] == a[key], key
    assert httpx.post(proxy.url + "/v1/trajectories/ack", json={"lease_id": meta["splice.lease_id"]}).status_code == 200
    empty = httpx.post(proxy.url + "/v1/trajectories/pull", json={"max_samples": 10}, headers={"Accept": ARROW})
    meta, rows = arrow_rows(empty.content)
    assert rows == [] and "splice.lease_id" not in meta


def test_trainer_client_reads_arrow_into_numpy(proxy):
    with ProxyClient(proxy.url) as c:
        lease, samples = c.pull(10)
    check_expected(samples)
    s = samples[0]
    assert s["input_ids"].dtype == np.int32 and s["logprobs"].dtype == np.float32 and s["loss_mask"].dtype == np.uint8
    assert s["input_ids"].flags.writeable and c.last_pull["schema_version"] == 1 and c.last_pull["dropped_stale"] == 0
    proxy.clock.t += LEASE_S + 1
    with ProxyClient(proxy.url, arrow=False) as c:
        lease2, json_samples = c.pull(10)
        c.ack(lease2)
    assert lease2 != lease
    for a, j in zip(samples, json_samples):
        assert all(np.array_equal(a[k], np.asarray(j[k], a[k].dtype)) for k in ARRAYS)


def test_sample_page_leases_nothing(proxy):
    r = httpx.get(proxy.url + "/v1/trajectories/samples", params={"limit": 1}, headers={"Accept": ARROW})
    meta, rows = arrow_rows(r.content)
    assert [s["sample_id"] for s in rows] == ["a:0", "a:1"] and "splice.next_cursor" in meta
    r = httpx.get(proxy.url + "/v1/trajectories/samples", params={"limit": 1, "cursor": meta["splice.next_cursor"]})
    page = r.json()
    assert [s["sample_id"] for s in page["samples"]] == ["b:0"] and page["has_more"] is False
    Draft202012Validator({**SCHEMA, "$ref": "#/$defs/sample"}).validate(page["samples"][0])
    assert proxy.store.stats()["sessions_leased"] == 0
    lease, samples = proxy.store.pool.pull(10, 10.0)
    assert len(samples) == 3  # still all there for the trainer
    proxy.store.pool.ack(lease)
    assert httpx.get(proxy.url + "/v1/trajectories/samples").json()["samples"] == []
    assert len(httpx.get(proxy.url + "/v1/trajectories/samples", params={"acked": "true"}).json()["samples"]) == 3
    assert httpx.get(proxy.url + "/v1/trajectories/samples", params={"since": 1001.5, "acked": "true"}).json()["samples"][0]["sample_id"] == "b:0"
    bad = httpx.get(proxy.url + "/v1/trajectories/samples", params={"cursor": "nope"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_value"
