"""Every way ``splice serve`` exits stops what it started: SIGTERM (Docker, Kubernetes) and
SIGINT while serving, SIGTERM while the bundled engine is still starting, and ``kill -9`` of the
proxy itself. Real processes: the proxy runs in its own session, so every process it started
is found by session id in ``/proc`` and none may survive."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from engines.reference.launch import free_port
from tests.e2e.conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")]


def _session_members(sid: int) -> list[int]:
    """Pids of live (not zombie) processes in session ``sid``."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        state, session = fields[0], int(fields[3])
        if session == sid and state != "Z":
            out.append(int(d.name))
    return out


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _start(tmp_path: Path, model_dir: str, *, sigint_ignored: bool = False) -> tuple[subprocess.Popen, str]:
    """``sigint_ignored``: started as ``splice serve &`` from a script is (a background job of a
    shell without job control inherits SIGINT ignored)."""
    port = free_port()
    args = [sys.executable, "-m", "proxy.cli", "serve", "--port", str(port), "--store", str(tmp_path / "s.sqlite"),
            "--reference-model", model_dir]  # fmt: skip
    proc = subprocess.Popen(args, cwd=str(tmp_path), env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=_ignore_sigint if sigint_ignored else None)  # fmt: skip
    return proc, f"http://127.0.0.1:{port}"


def _wait_healthy(proc: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError("splice serve did not become healthy")


def _engine_started(proc: subprocess.Popen) -> None:
    """Wait until the proxy has a child (the engine, still loading)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if len(_session_members(proc.pid)) >= 2:
            return
        time.sleep(0.05)
    raise TimeoutError("no engine child appeared")


def _none_survive(proc: subprocess.Popen, timeout_s: float = 30.0) -> int | None:
    """Wait for the proxy to exit and every process of its session to be gone; the exit status."""
    rc = None
    try:
        rc = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + timeout_s
    while _session_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _session_members(proc.pid)
    if left:  # clean up before failing, so a failure leaves nothing running
        os.killpg(proc.pid, signal.SIGKILL)
    assert not left, f"processes outlived splice serve: {left}"
    return rc


@pytest.mark.parametrize("sig, code, sigint_ignored", [(signal.SIGTERM, 143, False), (signal.SIGINT, 130, False),
                                                      (signal.SIGINT, 130, True)])
def test_signal_while_serving_stops_the_engine(tmp_path, model_dir, sig, code, sigint_ignored):
    proc, url = _start(tmp_path, model_dir, sigint_ignored=sigint_ignored)
    _wait_healthy(proc, url)
    assert len(_session_members(proc.pid)) >= 2  # the proxy and its engine
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, timeout=60)
    assert r.status_code == 200
    proc.send_signal(sig)  # to the proxy only, as `docker stop` / `kill PID` does
    assert _none_survive(proc) == code


def test_sigterm_while_the_engine_starts(tmp_path, model_dir):
    proc, url = _start(tmp_path, model_dir)
    _engine_started(proc)
    proc.send_signal(signal.SIGTERM)
    assert _none_survive(proc) == 143


def test_kill_9_of_the_proxy_takes_the_engine_with_it(tmp_path, model_dir):
    proc, url = _start(tmp_path, model_dir)
    _wait_healthy(proc, url)
    proc.kill()
    _none_survive(proc)
