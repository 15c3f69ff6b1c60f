"""The fleet publish protocol (docs/fleet.md) against fake proxies sharing fake engines."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from trainer_bridge.client import ProxyClient, resolve_proxies
from trainer_bridge.publish import PublishError, engine_replicas, main, plan_loads, publish


class Fleet:
    """Proxies (URL -> engine ids) over shared engines (id -> version, loads), as an httpx transport."""

    def __init__(self, proxies: dict[str, list[str]], *, fail: dict[tuple[str, str], int] | None = None):
        self.proxies = proxies
        self.engines = {e: {"version": 0, "loads": 0} for es in proxies.values() for e in es}
        self.state = {p: {"paused": False, "version": 0, "model_path": None} for p in proxies}
        self.log: list[tuple[str, str, dict]] = []
        self.fail = fail or {}
        self.lock = threading.Lock()

    def handler(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        path = request.url.path
        body = json.loads(request.content) if request.content else {}
        with self.lock:
            self.log.append((base, path, body))
            st = self.state[base]
            if (base, path) in self.fail:
                return httpx.Response(self.fail[(base, path)], json={"error": {"message": f"boom at {path}", "type": "server_error", "code": "x"}})
            if path == "/admin/status":
                reps = [{"id": e, "url": e, "healthy": True, "stale": False, "weight_version": self.engines[e]["version"]} for e in self.proxies[base]]
                return httpx.Response(200, json={"version": st["version"], "paused": st["paused"], "engines": {"engine_replicas": reps}})
            if path == "/admin/recompute":
                assert not any(s["paused"] for s in self.state.values()), "recompute after a pause would block"
                return httpx.Response(200, json={"recomputed_tokens": 2})
            if path == "/admin/pause":
                assert request.url.params.get("recompute") == "false"
                st["paused"] = True
                return httpx.Response(200, json={"paused": True, "recomputed_tokens": 0})
            if path == "/admin/update_weights":
                loaded, skipped = [], []
                for e in body["engines"]:
                    assert e in self.proxies[base]
                    if self.engines[e]["version"] == body["version"]:
                        skipped.append(e)
                    else:
                        self.engines[e]["version"] = body["version"]
                        self.engines[e]["loads"] += 1
                        loaded.append(e)
                st["version"] = body["version"]
                return httpx.Response(200, json={"success": True, "version": body["version"], "loaded": loaded, "skipped": skipped, "stale": []})
            if path == "/admin/version":
                st["version"], st["model_path"] = body["version"], body.get("model_path")
                return httpx.Response(200, json={"version": body["version"]})
            if path == "/admin/resume":
                st["paused"] = False
                return httpx.Response(200, json={"paused": False})
        return httpx.Response(404, json={"error": {"message": "no route", "type": "not_found", "code": None}})

    def client(self) -> ProxyClient:
        return ProxyClient(list(self.proxies), admin_token="t", transport=httpx.MockTransport(self.handler), max_retries=0)


P = [f"http://127.0.0.1:{8000 + i}" for i in range(3)]
E1, E2 = "http://engine-1:30000", "http://engine-2:30000"


def test_each_engine_loads_once_every_proxy_learns_the_version_before_any_resumes():
    fleet = Fleet({P[0]: [E1, E2], P[1]: [E1, E2], P[2]: [E2, E1]})
    report = publish(P, "/ckpt/step_1", 1, client=fleet.client())
    assert report.ok and report.engines == [E1, E2]
    assert {e: s["loads"] for e, s in fleet.engines.items()} == {E1: 1, E2: 1}
    assert sorted(report.loaded) == [E1, E2] and report.skipped == []
    assert len(set(report.loaders.values())) == 2  # the two loads go through two different proxies
    assert all(s["version"] == 1 and not s["paused"] for s in fleet.state.values())
    assert report.recomputed_tokens == 6
    steps = [p for _, p, _ in fleet.log]
    last_recompute = max(i for i, p in enumerate(steps) if p == "/admin/recompute")
    first_pause = min(i for i, p in enumerate(steps) if p == "/admin/pause")
    assert last_recompute < first_pause  # no proxy recomputes against engines another one paused
    last_pause = max(i for i, p in enumerate(steps) if p == "/admin/pause")
    first_load = min(i for i, p in enumerate(steps) if p == "/admin/update_weights")
    last_learn = max(i for i, p in enumerate(steps) if p in ("/admin/update_weights", "/admin/version"))
    first_resume = min(i for i, p in enumerate(steps) if p == "/admin/resume")
    assert last_pause < first_load and last_learn < first_resume
    assert steps.count("/admin/resume") == 3 and steps.count("/admin/pause") == 3
    learners = [b for b, p, _ in fleet.log if p == "/admin/version"]
    assert len(learners) == 1  # the third proxy only learns the version (with where the weights are)
    assert fleet.state[learners[0]]["model_path"] == "/ckpt/step_1"
    assert set(report.timings_s) >= {"status", "pause", "load", "version", "resume", "total"}


def test_rerun_with_the_same_version_loads_nothing_again():
    fleet = Fleet({P[0]: [E1], P[1]: [E1, E2]})
    publish(P[:2], "/ckpt/step_1", 1, client=fleet.client())
    again = publish(P[:2], "/ckpt/step_1", 1, client=fleet.client())
    assert again.ok and again.loaded == [] and sorted(again.skipped) == [E1, E2]
    assert {e: s["loads"] for e, s in fleet.engines.items()} == {E1: 1, E2: 1}


@pytest.mark.parametrize("step", ["/admin/pause", "/admin/update_weights", "/admin/version"])
def test_a_failed_step_leaves_no_proxy_paused_and_names_the_proxy(step):
    fleet = Fleet({P[0]: [E1], P[1]: [E2], P[2]: [E1]})
    victim = P[2] if step == "/admin/version" else P[1]
    fleet.fail[(victim, step)] = 502
    with pytest.raises(PublishError) as info:
        publish(P, "/ckpt/step_1", 1, client=fleet.client())
    err = info.value
    assert err.proxy == victim and victim in str(err) and "boom" in str(err)
    assert err.step == {"/admin/pause": "pause", "/admin/update_weights": "load", "/admin/version": "version"}[step]
    assert err.status == 502 and not err.report.ok
    if step == "/admin/update_weights":
        assert err.engines == [E2] and E2 in str(err)
    assert not any(s["paused"] for s in fleet.state.values())
    assert [p for _, p, _ in fleet.log].count("/admin/resume") == 3


def test_a_failed_status_touches_nothing():
    fleet = Fleet({P[0]: [E1], P[1]: [E1]})
    fleet.fail[(P[1], "/admin/status")] = 500
    with pytest.raises(PublishError, match="status failed at proxy http://127.0.0.1:8001"):
        publish(P[:2], "/ckpt", 1, client=fleet.client())
    assert all(p == "/admin/status" for _, p, _ in fleet.log)


def test_a_failed_resume_is_reported_after_resuming_the_others():
    fleet = Fleet({P[0]: [E1], P[1]: [E1]})
    fleet.fail[(P[0], "/admin/resume")] = 500
    with pytest.raises(PublishError) as info:
        publish(P[:2], "/ckpt", 1, client=fleet.client())
    assert info.value.step == "resume" and info.value.proxy == P[0]
    assert not fleet.state[P[1]]["paused"]


def test_proxy_client_publish_runs_the_fleet_protocol_and_train_style_calls_work():
    fleet = Fleet({P[0]: [E1], P[1]: [E1]})
    report = fleet.client().publish("/ckpt/step_3", 7)
    assert report.ok and fleet.engines[E1] == {"version": 7, "loads": 1}


def test_plan_spreads_engines_and_prefers_healthy_holders():
    st = [
        {"engines": {"engine_replicas": [{"id": "a", "healthy": False}, {"id": "b", "healthy": True}]}},
        {"engines": {"engine_replicas": [{"id": "a", "healthy": True}, {"id": "b", "healthy": True}]}},
    ]
    engines, assigned = plan_loads(st)
    assert engines == ["a", "b"] and assigned == {"a": 1, "b": 0}
    # a proxy that predates engine ids: its replica URLs are the identity
    old = {"engines": {"replicas": [{"url": "HTTP://Engine-A:30000/", "healthy": True}]}}
    assert engine_replicas(old)[0]["id"] == "http://engine-a:30000"


def test_dns_names_expand_to_every_address():
    urls = resolve_proxies(["dns://localhost:8123", "http://x:1/"])
    assert "http://127.0.0.1:8123" in urls and urls[-1] == "http://x:1"
    with pytest.raises(ValueError):
        resolve_proxies("dns://no-port")


def test_cli_reports_failure_with_exit_code(capsys):
    # nothing listens on this port: the first step (pause) fails; resuming is attempted anyway
    code = main(["--proxy", "http://127.0.0.1:9", "--model-path", "/x", "--version", "1", "--timeout-s", "2"])
    assert code == 1
    assert "pause failed at proxy http://127.0.0.1:9" in capsys.readouterr().err
