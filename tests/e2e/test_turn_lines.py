"""``splice serve``'s console at the default log level: one line per finished turn (session,
turn, where it landed, tokens, engine / proxy time), a progress line for a turn still running
after a few seconds, and nothing of the kind under ``--quiet``. The numbers on each line are
checked against the session as stored (``GET /v1/sessions/{id}``)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import httpx
import pytest
from openai import OpenAI

from engines.reference.launch import free_port
from tests.e2e.conftest import ROOT, admin_headers

pytestmark = pytest.mark.slow

SCRIPT_SHORT = "Hi.<|im_end|>"
SCRIPT_SLOW = " ".join(["word"] * 70) + "<|im_end|>"  # 70+ tokens at 100 ms: past the 5 s progress mark
SCRIPT = [SCRIPT_SHORT, SCRIPT_SLOW]


def _serve(tmp_path, model_dir: str, *extra: str):
    import json

    port = free_port()
    script = tmp_path / f"script-{port}.json"
    script.write_text(json.dumps(SCRIPT))
    err = open(tmp_path / f"serve-{port}.err", "w+")
    args = [sys.executable, "-m", "proxy.cli", "serve", "--port", str(port), "--store", str(tmp_path / f"s-{port}.sqlite"),
            "--reference-model", model_dir, "--reference-script", str(script), "--reference-script-delay-ms", "100", *extra]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPLICE_")}
    proc = subprocess.Popen(args, cwd=str(tmp_path), env={**env, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
                            stderr=err, start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert proc.poll() is None, open(err.name).read()[-3000:]
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url, err.name
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError("splice serve did not become healthy")


def _stop(proc) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _chat(url: str, session: str, messages: list[dict]) -> str:
    client = OpenAI(base_url=url + "/v1", api_key="unused", default_headers={"X-Session-Id": session})
    return client.chat.completions.create(model="any", messages=messages).choices[0].message.content


def _lines(path: str) -> list[str]:
    return open(path).read().splitlines()


def test_a_line_per_turn_and_a_progress_line(tmp_path, model_dir):
    proc, url, err = _serve(tmp_path, model_dir)
    try:
        history = [{"role": "user", "content": "hello " * 30}]  # long enough for the engine's prefix reuse
        first = _chat(url, "tl-1", history)
        history += [{"role": "assistant", "content": first}, {"role": "user", "content": "more please"}]
        _chat(url, "tl-1", history)
        turns = httpx.get(f"{url}/v1/sessions/tl-1", headers=admin_headers(), timeout=30).json()["turns"]
        time.sleep(0.5)  # the line is written right after the response; let it reach the file
        lines = _lines(err)
    finally:
        _stop(proc)
    assert len(turns) == 2 and turns[1]["spliced"]
    t0, t1 = turns
    pat = r"session tl-1 turn {i} \[main\]: {where}, {p} prompt{cached} \+ {o} output tokens, stop \| engine \d+ ms, proxy \d+ ms$"
    want0 = pat.format(i=0, where="new", p=f"{len(t0['prompt_ids']):,}", cached="", o=len(t0["output_ids"]))
    # the engine reuses the first turn's KV: all of it but the last sampled token, which was never fed back
    reused = len(t0["prompt_ids"]) + len(t0["output_ids"]) - 1
    want1 = pat.format(i=1, where="spliced", p=f"{len(t1['prompt_ids']):,}", cached=rf" \({reused:,} cached\)", o=len(t1["output_ids"]))
    assert sum(bool(re.search(want0, x)) for x in lines) == 1, "\n".join(lines)
    assert sum(bool(re.search(want1, x)) for x in lines) == 1, "\n".join(lines)
    progress = [x for x in lines if "still running after" in x]
    assert progress and re.search(rf"turn \w+ of session tl-1 still running after \d+ s \({len(t1['prompt_ids']):,} prompt tokens", progress[0])
    assert lines.index(progress[0]) < next(i for i, x in enumerate(lines) if re.search(want1, x))


def test_quiet_prints_no_turn_lines(tmp_path, model_dir):
    proc, url, err = _serve(tmp_path, model_dir, "--quiet")
    try:
        assert _chat(url, "tl-q", [{"role": "user", "content": "hello"}]) == "Hi."
        assert len(httpx.get(f"{url}/v1/sessions/tl-q", headers=admin_headers(), timeout=30).json()["turns"]) == 1
        time.sleep(0.5)
        lines = _lines(err)
    finally:
        _stop(proc)
    assert not [x for x in lines if "session tl-q" in x or "still running" in x], "\n".join(lines)
