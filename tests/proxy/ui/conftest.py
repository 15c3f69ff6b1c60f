"""A real headless Chromium (Debian's ``chromium`` + ``chromium-driver``, driven by Selenium)
in front of a real ``splice serve`` with the reference engine serving a tiny Qwen2.5-VL model.

The recorded session the viewer tests look at: turn 0 carries an image and is streamed while
the engines are paused, given new weights (version 1) and resumed, so its versions change in
the middle of the turn; turn 1 is spliced onto it and calls a tool; turn 2 offers tools the
history never had, so it forks (``tools_changed``). Other sessions fill the table: a rewarded
group, unrewarded ones, and two with turns of other episode roles (``X-Splice-Role``): an agent's
conversation with a side call (a title), and a sub-agent's conversation with a side call.
"""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from engines.reference.launch import free_port
from tests.e2e.conftest import ROOT, Proxy, kill_tree

CHROMIUM = os.environ.get("SPLICE_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = os.environ.get("SPLICE_CHROMEDRIVER", "/usr/bin/chromedriver")
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage", "--window-size=1400,1000",
]  # fmt: skip
ARTIFACTS = Path(os.environ.get("SPLICE_ARTIFACTS", Path(__file__).resolve().parents[3] / "artifacts"))

ADMIN = "adm"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
LONG = (
    "<think>The screen shows a form; the blue button submits it.</think>"
    "I will click the blue button in the lower right corner of the form, then wait for the page "
    "to load and read the confirmation message that appears at the top of the window.<|im_end|>"
)
CALL = '<tool_call>\n{"name": "click", "arguments": {"x": 120, "y": 48}}\n</tool_call><|im_end|>'
SCRIPT = [LONG, CALL, "Done: the form was submitted.<|im_end|>"] + [f"Answer {k}.<|im_end|>" for k in range(40)]
DELAY_MS = 35
TITLE_REQUEST = "Write a five-word title for this conversation."
TOOLS = [{"type": "function", "function": {"name": "click", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}}}}]


def browser_options(user_data_dir: str):
    from selenium.webdriver.chrome.options import Options

    opts = Options()
    opts.binary_location = CHROMIUM
    for flag in FLAGS:
        opts.add_argument(flag)
    opts.add_argument(f"--user-data-dir={user_data_dir}")
    opts.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    return opts


def start_browser(user_data_dir: str):
    """A headless Chromium under chromedriver; both must be installed (``make install-browser``)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    for exe in (CHROMIUM, CHROMEDRIVER):
        if not os.access(exe, os.X_OK):
            pytest.fail(f"{exe} is missing: `make install-browser` installs Debian's chromium and chromium-driver")
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=browser_options(user_data_dir))


@pytest.fixture(scope="module")
def browser():
    profile = tempfile.mkdtemp(prefix="splice-chromium-")
    driver = start_browser(profile)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    from engines.reference.vision_files import ensure_vision_model

    return ensure_vision_model(tmp_path_factory.mktemp("vl") / "tiny-vl")


def png(seed: int, size=(96, 64)) -> bytes:
    w, h = size
    buf = io.BytesIO()
    Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8")).save(buf, "PNG")
    return buf.getvalue()


def chat(proxy, sid: str, messages: list, headers: dict | None = None, **extra) -> dict:
    r = httpx.post(proxy.url + "/v1/chat/completions", json={"model": "m", "messages": messages, **extra},
                   headers={"X-Session-Id": sid, **(headers or {})}, timeout=180)  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()


def admin(proxy, path: str, body: dict | None = None) -> dict:
    r = httpx.post(proxy.url + path, json=body or {}, headers=AUTH, timeout=180)
    assert r.status_code == 200, (path, r.text)
    return r.json()


def _streamed_turn_across_an_update(proxy, sid: str, messages: list, weights: str) -> str:
    """Turn 0: streamed; paused after a dozen tokens, new weights as version 1, resumed.
    Returns the answer's text as the client received it."""
    content: list[str] = []
    started = threading.Event()
    result: dict = {}

    def agent():
        try:
            with httpx.stream("POST", proxy.url + "/v1/chat/completions", json={"model": "m", "messages": messages, "stream": True},
                              headers={"X-Session-Id": sid}, timeout=180) as r:  # fmt: skip
                result["status"] = r.status_code
                n = 0
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    for choice in json.loads(line[6:]).get("choices", []):
                        delta = choice.get("delta") or {}
                        content.append(delta.get("content") or "")
                        n += 1
                        if n >= 12:
                            started.set()
        except Exception as exc:  # noqa: BLE001 - reported below
            result["error"] = exc
        finally:
            started.set()

    th = threading.Thread(target=agent)
    th.start()
    assert started.wait(120)
    admin(proxy, "/admin/pause")
    admin(proxy, "/admin/update_weights", {"model_path": weights, "version": 1})
    admin(proxy, "/admin/resume")
    th.join(180)
    assert result.get("status") == 200 and "error" not in result, result
    return "".join(content)


def _start(tmp_path: Path, model: str, deadline_s: float = 600.0) -> Proxy:
    """``splice serve`` as ``start_proxy`` starts it, with more patience: loading the engine's
    vision model takes minutes on a loaded machine."""
    port = free_port()
    store = str(tmp_path / "splice.sqlite")
    script = tmp_path / "script.json"
    script.write_text(json.dumps(SCRIPT))
    args = [sys.executable, "-m", "proxy.cli", "serve", "--port", str(port), "--store", store, "--reference-model", model,
            "--reference-script", str(script), "--reference-script-delay-ms", str(DELAY_MS), "--admin-token", ADMIN]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(args, cwd=str(tmp_path), env=env, start_new_session=True)
    proxy = Proxy(f"http://127.0.0.1:{port}", proc, store, args, env)
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"splice serve exited with {proc.returncode}")
        try:
            if httpx.get(proxy.url + "/health", timeout=1).status_code == 200:
                return proxy
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    kill_tree(proxy)
    raise AssertionError(f"splice serve did not become healthy in {deadline_s} s")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, vl_dir):
    """The proxy, and the ids of the sessions it recorded (see the module docstring)."""
    from engines.reference.model_init import perturb_model

    v1 = str(perturb_model(vl_dir, tmp_path_factory.mktemp("vlw") / "v1", seed=5, scale=0.05))
    proxy = _start(tmp_path_factory.mktemp("uiproxy"), str(vl_dir))
    try:
        main = "viewer-" + uuid.uuid4().hex[:8]
        image = "data:image/png;base64," + base64.b64encode(png(1)).decode()
        msgs = [{"role": "user", "content": [{"type": "text", "text": "Submit the form."}, {"type": "image_url", "image_url": {"url": image}}]}]
        answer = _streamed_turn_across_an_update(proxy, main, msgs, v1)
        msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Go on."}]
        chat(proxy, main, msgs)  # turn 1: spliced onto turn 0, emits a tool call
        chat(proxy, main, msgs, tools=TOOLS)  # turn 2: tools the history never had: a fork
        # the table's other rows: a rewarded group of three, two sessions without a reward
        group = "grp-" + uuid.uuid4().hex[:6]
        others = []
        for k in range(5):
            sid = f"other-{k}-" + uuid.uuid4().hex[:6]
            chat(proxy, sid, [{"role": "user", "content": f"Question {k}?"}], headers={"X-Group-Id": group} if k < 3 else None)
            others.append(sid)
        for sid in others[:3]:
            r = httpx.post(f"{proxy.url}/v1/sessions/{sid}/reward", json={"reward": 0.5}, headers=AUTH, timeout=30)
            assert r.status_code == 200, r.text
        # episode roles: an agent's main turn and a side call; a sub-agent's turn and a side call
        episode = "episode-" + uuid.uuid4().hex[:6]
        chat(proxy, episode, [{"role": "user", "content": "Click the button."}], tools=TOOLS)
        chat(proxy, episode, [{"role": "user", "content": TITLE_REQUEST}], headers={"X-Splice-Role": "auxiliary"})
        subagent = "subagent-" + uuid.uuid4().hex[:6]
        chat(proxy, subagent, [{"role": "user", "content": "Find the form."}], headers={"X-Splice-Role": "subagent"}, tools=TOOLS)
        chat(proxy, subagent, [{"role": "user", "content": TITLE_REQUEST}], headers={"X-Splice-Role": "auxiliary"})
        yield {"proxy": proxy, "main": main, "others": others, "group": group, "vl_dir": vl_dir, "episode": episode,
               "subagent": subagent}
    finally:
        kill_tree(proxy)


def wait_ready(driver, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = driver.execute_script("return document.body && document.body.dataset.ready")
        if state == "1":
            return
        if state == "error":
            raise AssertionError("the page shows an error: " + driver.find_element("id", "main").text)
        time.sleep(0.05)
    raise AssertionError("the page did not finish loading")
