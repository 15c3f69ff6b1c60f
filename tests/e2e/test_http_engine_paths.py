"""``model_path`` belongs to the engine's filesystem (the compose deployment: the proxy does not
mount the weights volume). The proxy passes it through and the engine's answer decides."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from engines.reference.launch import free_port, wait_healthy
from tests.e2e.conftest import ROOT, kill_tree, start_proxy, admin_headers

pytestmark = pytest.mark.slow


def test_weights_only_the_engine_can_see(tmp_path, model_dir):
    from engines.reference.model_init import perturb_model

    engine_root = tmp_path / "engine-fs"
    engine_root.mkdir()
    perturb_model(model_dir, engine_root / "weights" / "step1", seed=5, scale=0.05)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    engine = subprocess.Popen(
        [sys.executable, "-m", "engines.reference", "--model", model_dir, "--host", "127.0.0.1", "--port", str(port)],
        cwd=engine_root, env=env,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    proxy = None
    try:
        wait_healthy(url, 90, alive=lambda: engine.poll() is None)
        proxy_root = tmp_path / "proxy-fs"
        proxy_root.mkdir()
        proxy = start_proxy(proxy_root, model_dir, extra=["--engine", "sglang", "--engine-url", url, "--tokenizer", model_dir])
        assert not (proxy_root / "weights" / "step1").exists()  # relative to the proxy: nothing there
        admin = lambda path, body: httpx.post(proxy.url + path, json=body, headers=admin_headers(), timeout=120)  # noqa: E731
        assert admin("/admin/pause", {}).status_code == 200
        r = admin("/admin/update_weights", {"model_path": "weights/step1", "version": 1})
        assert r.status_code == 200, r.text
        assert r.json()["version"] == 1
        assert admin("/admin/resume", {}).status_code == 200
        info = httpx.get(url + "/model_info", timeout=30).json()
        assert str(info.get("weight_version")) == "1"
        # a path the engine cannot see either is refused by the engine, and nothing changes
        assert admin("/admin/pause", {}).status_code == 200
        bad = admin("/admin/update_weights", {"model_path": "weights/missing", "version": 2})
        assert bad.status_code >= 400 and "error" in bad.json()
        assert admin("/admin/resume", {}).status_code == 200
        assert httpx.get(proxy.url + "/admin/status", headers=admin_headers(), timeout=30).json()["version"] == 1
    finally:
        if proxy is not None:
            kill_tree(proxy)
        engine.terminate()
        engine.wait(20)
