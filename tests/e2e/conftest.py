"""Real processes over loopback: the reference engine (script mode) behind ``splice serve``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from engines.reference.launch import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    from engines.reference.model_init import ensure_model

    return str(ensure_model(tmp_path_factory.mktemp("model") / "tiny"))


def admin_headers() -> dict[str, str]:
    """The admin token of every proxy these tests start without ``--admin-token``: the one
    ``splice serve`` keeps in ``$SPLICE_HOME/admin_token`` (created here first if missing, by the
    same function, so it is known before a proxy starts)."""
    from proxy.auth import load_or_create_admin_token

    return {"Authorization": f"Bearer {load_or_create_admin_token()[0]}"}


class Proxy:
    def __init__(self, url: str, proc: subprocess.Popen, store: str, args: list[str], env: dict):
        self.url = url
        self.proc = proc
        self.store = store
        self.args = args
        self.env = env

    @property
    def admin_token(self) -> str:
        """The proxy's admin token: ``--admin-token`` or ``SPLICE_ADMIN_TOKEN`` if given, else the one
        ``splice serve`` generated into ``$SPLICE_HOME/admin_token`` (of the proxy's environment)."""
        if "--admin-token" in self.args:
            return self.args[self.args.index("--admin-token") + 1]
        if self.env.get("SPLICE_ADMIN_TOKEN"):
            return self.env["SPLICE_ADMIN_TOKEN"]
        home = self.env.get("SPLICE_HOME") or str(Path.home() / ".cache" / "splice")
        return (Path(home) / "admin_token").read_text().strip()

    @property
    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"}

    def get(self, path: str, **kw):
        """GET with the admin token unless ``headers`` are given (agent routes ignore it without --api-key)."""
        kw.setdefault("headers", self.admin)
        return httpx.get(self.url + path, timeout=60, **kw)

    def post(self, path: str, body=None, **kw):
        kw.setdefault("headers", self.admin)
        return httpx.post(self.url + path, json=body if body is not None else {}, timeout=120, **kw)

    def stop(self, sig_kill: bool = False) -> None:
        if self.proc.poll() is None:
            if sig_kill:
                # kill -9 the proxy; its engine child is stopped separately by the caller
                self.proc.kill()
            else:
                self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_proxy(tmp_path: Path, model_dir: str | None, *, script: list[str] | None = None, delay_ms: int = 0, extra: list[str] | None = None, store: str | None = None, port: int | None = None, env: dict | None = None, start_timeout_s: float = 300.0) -> Proxy:
    """``splice serve`` as a child process; ``model_dir=None`` serves the bundled default model
    (under ``$SPLICE_HOME``, which ``env`` may set)."""
    port = port or free_port()
    store = store or str(tmp_path / "splice.sqlite")
    args = [sys.executable, "-m", "proxy.cli", "serve", "--port", str(port), "--store", store]
    if model_dir is not None:
        args += ["--reference-model", model_dir]
    if script is not None:
        sf = tmp_path / f"script-{port}.json"
        sf.write_text(json.dumps(script))
        args += ["--reference-script", str(sf), "--reference-script-delay-ms", str(delay_ms)]
    args += extra or []
    env = {**os.environ, **(env or {}), "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(args, cwd=str(tmp_path), env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + max(start_timeout_s, float(os.environ.get("SPLICE_TEST_START_TIMEOUT_S", "0")))  # raise it on a loaded machine
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"splice serve exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return Proxy(url, proc, store, args, env)
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise RuntimeError("splice serve did not become healthy")


def kill_tree(proxy: Proxy) -> None:
    """kill -9 the proxy and its engine child (same process group)."""
    import signal

    try:
        os.killpg(proxy.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proxy.proc.wait()


@pytest.fixture
def proxy_factory(tmp_path, model_dir):
    started: list[Proxy] = []

    def make(**kw) -> Proxy:
        p = start_proxy(tmp_path, model_dir, **kw)
        started.append(p)
        return p

    yield make
    for p in started:
        if p.proc.poll() is None:
            kill_tree(p)
