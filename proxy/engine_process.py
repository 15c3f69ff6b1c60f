"""Start and stop the bundled reference engine as a child process (the embedded default)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    """Poll ``url/health`` until it answers 200; fail fast if ``proc`` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[2] if len(proc.args) > 2 else proc.args} exited with code {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not become healthy within {timeout_s:.0f}s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EngineProcess:
    """``python -m engines.reference`` on a free loopback port; waits for ``/health``."""

    def __init__(self, model_dir: str, *, script: str | None = None, script_delay_ms: int = 0, port: int | None = None):
        self.model_dir = model_dir
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "engines.reference", "--model", model_dir, "--port", str(self.port)]
        if script:
            cmd += ["--script", script, "--script-delay-ms", str(script_delay_ms)]
        self.proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def wait_ready(self, timeout_s: float = 120.0) -> "EngineProcess":
        try:
            wait_healthy(self.url, self.proc, timeout_s)
        except RuntimeError:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
