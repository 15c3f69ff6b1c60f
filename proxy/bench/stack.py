"""The benchmarks' system under test: a zero-latency engine stand-in (``standin.py``, its own
process) and ``splice serve`` in front of it, on free loopback ports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from engines.reference.launch import free_port

HERE = Path(__file__).resolve().parent
# What the stand-in answers every turn with: reasoning, then one tool call.
REPLY_TEXT = '<think>\nI should call f.\n</think>\n\n<tool_call>\n{"name":"f","arguments":{"x":1}}\n</tool_call><|im_end|>'


def reply_ids(tok, reasoning_tokens: int = 0) -> list[int]:
    """The stand-in's reply as ids; ``reasoning_tokens`` > 0 makes its thinking that many tokens
    longer (about): agents that reason write hundreds to thousands of tokens a turn, and what
    the proxy does per output token only shows at that length."""
    mark = "I should call f."
    target = len(tok.encode(REPLY_TEXT, add_special_tokens=False)) + max(0, reasoning_tokens)
    steps, k = "", 0
    while len(ids := tok.encode(REPLY_TEXT.replace(mark, mark + steps), add_special_tokens=False)) < target:
        steps += f" Step {k} checks the value again."
        k += 1
    return list(ids)


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 90.0) -> str | None:
    """None once ``url`` answers; otherwise why not."""
    import httpx

    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            return f"exited with {proc.returncode}"
        try:
            if httpx.get(url, timeout=2.0).status_code < 500:
                return None
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    return f"did not answer {url} in {timeout:.0f}s"


def start_standin(tmp: str, tok, out_ids: list[int], procs: list[subprocess.Popen], **spec) -> str:
    """Start the stand-in (appended to ``procs``); returns its URL. ``spec``: extra stand-in keys."""
    spec_path = os.path.join(tmp, "standin.json")
    with open(spec_path, "w") as f:
        json.dump({"out_ids": out_ids, "stop_id": tok.convert_tokens_to_ids("<|im_end|>"), "reasoning": "I should call f.",
                   "tool_call": {"name": "f", "arguments": '{"x": 1}'}, **spec}, f)  # fmt: skip
    port = free_port()
    procs.append(subprocess.Popen([sys.executable, str(HERE / "standin.py"), str(port), spec_path]))
    url = f"http://127.0.0.1:{port}"
    if why := wait_http(url + "/health", procs[-1]):
        raise SystemExit(f"engine stand-in: {why}")
    return url


def start_splice(tmp: str, engine_url: str, tok_dir: str, procs: list[subprocess.Popen], extra: list[str] = (),
                 renderer: str = "qwen3", tree: str | None = None) -> int:
    """``splice serve`` in front of ``engine_url`` (appended to ``procs``, not yet waited for); returns its port.
    ``tree``: serve the Splice in that directory instead of this one (``splice bench paired``)."""
    port = free_port()
    # SPLICE_QUIET: no per-turn console lines in the measured proxy (an older tree ignores it)
    env = {**os.environ, "PYTHONPATH": (tree or str(HERE.parents[1])) + os.pathsep + os.environ.get("PYTHONPATH", ""), "SPLICE_QUIET": "1"}
    procs.append(subprocess.Popen(
        [sys.executable, "-c", "import sys; from proxy.cli import main; sys.exit(main(sys.argv[1:]))",
         "serve", "--engine", "sglang", "--engine-url", engine_url, "--tokenizer", tok_dir, "--renderer", renderer,
         "--store", os.path.join(tmp, "splice.sqlite"), "--host", "127.0.0.1", "--port", str(port), *extra], env=env,
        cwd=tree,  # another tree: ``python -c`` puts the working directory first on the import path
    ))  # fmt: skip
    return port


def stop_all(procs: list[subprocess.Popen]) -> None:
    """Terminate what a bench started, newest first; kill what does not stop in 10 s."""
    for p in reversed(procs):
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
