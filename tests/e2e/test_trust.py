"""Trainer routes are never open by accident. ``splice serve --api-key K`` with no admin token
(a real process, its own ``$SPLICE_HOME``) generates one into ``$SPLICE_HOME/admin_token``
(mode 0600, named in the ready line): no credential and the agent key get 401 on every trainer
route the app serves (pulls, samples, acks, images, sessions, rewards, every ``/admin`` route,
enumerated from the proxy's own OpenAPI document), the generated token opens them, the trainer
client on this machine finds it, a restart keeps it, and SIGHUP shuts the proxy down gracefully
(exit 129)."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from engines.reference.launch import free_port
from tests.e2e.conftest import ROOT

pytestmark = pytest.mark.slow

AGENT_KEY = "agent-key-1"


def _serve(tmp_path: Path, model_dir: str, home: Path, *extra: str) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    log = tmp_path / f"serve-{port}.log"
    args = [sys.executable, "-m", "proxy.cli", "serve", "--port", str(port), "--store", str(tmp_path / "s.sqlite"),
            "--reference-model", model_dir, "--reference-script", str(tmp_path / "script.json"), *extra]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "SPLICE_ADMIN_TOKEN"}
    env.update(PYTHONPATH=str(ROOT), SPLICE_HOME=str(home))
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, cwd=str(tmp_path), env=env, start_new_session=True, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        if "splice ready" in log.read_text():
            return proc, url, log
        time.sleep(0.2)
    proc.kill()
    raise TimeoutError("splice serve did not become ready")


def _trainer_routes(url: str) -> list[tuple[str, str]]:
    spec = httpx.get(url + "/openapi.json", headers={"Authorization": f"Bearer {AGENT_KEY}"}, timeout=30).json()
    out = []
    for path, ops in spec["paths"].items():
        if path.startswith(("/admin", "/v1/trajectories", "/v1/images", "/v1/sessions")):
            concrete = path.replace("{session_id}", "s1").replace("{image_hash}", "a" * 64).replace("{hash}", "a" * 64)
            out += [(method.upper(), concrete) for method in ops]
    return out


def test_no_admin_token_given_means_a_generated_one(tmp_path, model_dir):
    import json

    (tmp_path / "script.json").write_text(json.dumps(["ok<|im_end|>"] * 4))
    home = tmp_path / "home"
    proc, url, log = _serve(tmp_path, model_dir, home, "--api-key", AGENT_KEY)
    token_file = home / "admin_token"
    try:
        assert f"admin token generated into {token_file}" in log.read_text()
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
        token = token_file.read_text().strip()
        assert len(token) >= 40 and token not in log.read_text()  # never printed
        admin = {"Authorization": f"Bearer {token}"}
        agent = {"Authorization": f"Bearer {AGENT_KEY}"}
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = httpx.post(url + "/v1/chat/completions", json=body, headers={**agent, "X-Session-Id": "s1"}, timeout=60)
        assert r.status_code == 200, r.text

        routes = _trainer_routes(url)
        paths = {p for _, p in routes}
        for must in ("/v1/trajectories/pull", "/v1/trajectories/samples", "/v1/trajectories/ack", "/v1/sessions",
                     "/v1/sessions/s1", "/v1/sessions/s1/reward", "/admin/pause", "/admin/resume", "/admin/version",
                     "/admin/status", "/admin/update_weights", "/admin/weights/commit"):  # fmt: skip
            assert must in paths, must
        assert any(p.startswith("/v1/images/") for p in paths)
        for method, path in routes:
            for headers in ({}, agent, {"x-api-key": AGENT_KEY}, {"Authorization": "Bearer wrong"}):
                r = httpx.request(method, url + path, json={"version": 7}, headers=headers, timeout=30)
                assert r.status_code == 401, (method, path, headers, r.status_code, r.text)
                assert r.json()["error"]["code"] == "invalid_api_key"
        # nothing moved: the refused version change did not land, the session is still open
        status = httpx.get(url + "/admin/status", headers=admin, timeout=30).json()
        assert status["version"] == 0 and not status["paused"]
        s = httpx.get(url + "/v1/sessions/s1", headers=admin, timeout=30).json()
        assert s["reward"] is None and len(s["turns"]) == 1
        assert httpx.get(url + "/metrics", timeout=30).status_code == 200  # loopback: open

        # the trainer client on this machine finds the token by itself (SPLICE_HOME as the proxy's)
        code = ("from trainer_bridge.client import ProxyClient\n"
                f"c = ProxyClient({url!r}, max_retries=0)\n"
                "print(c.status()['version'])")  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "SPLICE_ADMIN_TOKEN"}
        env.update(PYTHONPATH=str(ROOT), SPLICE_HOME=str(home))
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.strip() == "0", out.stderr[-2000:]
    finally:
        proc.send_signal(signal.SIGHUP)  # as the README says: a graceful shutdown
        rc = proc.wait(60)
    assert rc == 128 + signal.SIGHUP, log.read_text()[-2000:]
    assert "Traceback" not in log.read_text()

    # a restart reuses the token (a trainer that read it keeps working)
    proc, url, log = _serve(tmp_path, model_dir, home, "--api-key", AGENT_KEY)
    try:
        assert f"admin token read from {token_file}" in log.read_text()
        r = httpx.get(url + "/admin/status", headers={"Authorization": f"Bearer {token}"}, timeout=30)
        assert r.status_code == 200
    finally:
        proc.terminate()
        assert proc.wait(60) == 143


def test_a_token_file_others_can_read_is_refused(tmp_path, model_dir):
    home = tmp_path / "home"
    home.mkdir()
    (home / "admin_token").write_text("readable-by-all\n")
    os.chmod(home / "admin_token", 0o644)
    env = {k: v for k, v in os.environ.items() if k != "SPLICE_ADMIN_TOKEN"}
    env.update(PYTHONPATH=str(ROOT), SPLICE_HOME=str(home))
    out = subprocess.run([sys.executable, "-m", "proxy.cli", "serve", "--port", str(free_port()), "--store", str(tmp_path / "s.sqlite"),
                          "--reference-model", model_dir], env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2
    assert "chmod 600" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_agent_key_equal_to_the_admin_token_is_refused(tmp_path, model_dir):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "proxy.cli", "serve", "--port", str(free_port()), "--store", str(tmp_path / "s.sqlite"),
                          "--reference-model", model_dir, "--api-key", "same", "--admin-token", "same"],
                         env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2 and "--api-key equals the admin token" in out.stderr
