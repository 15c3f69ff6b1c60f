"""Start the reference engine as a child process: the one launcher for ``splice serve``'s
embedded default, ``splice demo``, benchmarks and tests.

``start_engine`` runs ``python -m engines.reference`` on a free loopback port, so the engine
has its own event loop and GIL exactly as in production, and waits for ``/health``.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> None:
    """Poll ``url``/health until it answers 200; raise TimeoutError (or RuntimeError if the server died)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"reference engine at {url} exited before becoming healthy")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"reference engine at {url} not healthy after {timeout_s:.0f}s")


def start_engine(
    model_dir: str | os.PathLike,
    *,
    script: str | os.PathLike | list[str] | None = None,
    script_delay_s: float = 0.0,
    token_delay_s: float = 0.0,
    weight_version: str = "0",
    served_model_name: str | None = None,
    seed: int = 0,
    threads: int = 1,
    port: int | None = None,
    extra_args: list[str] | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float = 90.0,
    capture_log: bool = True,
    die_with_parent: bool = False,
) -> tuple[str, Callable[[], None]]:
    """Run ``python -m engines.reference`` on a free loopback port; wait for /health.

    Returns ``(base_url, stop)``; ``stop()`` terminates the process (idempotent). ``script``
    may be a file path or a list of assistant texts (written to a temp file). On a failed
    start the engine's log is in the exception message. ``capture_log=False`` lets the engine
    write to this process's stdout/stderr (``splice serve``), so there is no log to quote.

    ``die_with_parent`` (Linux): the kernel sends the engine SIGTERM when the thread that
    started it ends, however that happens (``kill -9`` included), so a proxy never leaves its
    engine behind. Only for a caller whose starting thread lives as long as the engine should
    (``splice serve``'s main thread).
    """
    tmp = Path(tempfile.mkdtemp(prefix="splice-engine-"))
    args = [sys.executable, "-m", "engines.reference", "--model", str(model_dir), "--host", "127.0.0.1"]
    if script is not None:
        if not isinstance(script, (str, os.PathLike)):
            path = tmp / "script.json"
            path.write_text(json.dumps(list(script)))
            script = path
        args += ["--script", str(script), "--script-delay-ms", str(script_delay_s * 1000.0)]
    args += ["--token-delay-ms", str(token_delay_s * 1000.0), "--weight-version", str(weight_version)]
    args += ["--seed", str(seed), "--threads", str(threads)]
    if served_model_name:
        args += ["--served-model-name", served_model_name]
    args += list(extra_args or [])
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), full_env.get("PYTHONPATH", "")) if p)
    full_env.setdefault("HF_HUB_OFFLINE", "1")
    full_env.setdefault("TRANSFORMERS_OFFLINE", "1")

    last_error: Exception | None = None
    for _attempt in range(3):  # a free port can be taken between probing and binding
        chosen = port or free_port()
        url = f"http://127.0.0.1:{chosen}"
        log_path = tmp / f"engine-{chosen}.log"
        log_file = open(log_path, "wb")
        out = log_file if capture_log else None
        proc = subprocess.Popen(
            args + ["--port", str(chosen)], cwd=str(REPO_ROOT), env=full_env, stdout=out,
            stderr=subprocess.STDOUT if capture_log else None, preexec_fn=functools.partial(_die_with_parent, os.getpid()) if die_with_parent else None,
        )  # fmt: skip
        try:
            wait_healthy(url, timeout_s, alive=lambda: proc.poll() is None)
        except BaseException as e:  # a signal or Ctrl-C while waiting: the child goes too
            if not isinstance(e, (RuntimeError, TimeoutError)):
                _terminate(proc)
                log_file.close()
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            _terminate(proc)
            log_file.close()
            log = log_path.read_text(errors="replace")[-4000:]
            last_error = RuntimeError(f"{e}\n--- engine log ---\n{log}")
            if port is None and "address already in use" in log.lower():
                continue
            shutil.rmtree(tmp, ignore_errors=True)
            raise last_error from None
        stopped = threading.Event()

        def stop(proc=proc, log_file=log_file) -> None:
            if stopped.is_set():
                return
            stopped.set()
            _terminate(proc)
            log_file.close()
            shutil.rmtree(tmp, ignore_errors=True)

        return url, stop
    shutil.rmtree(tmp, ignore_errors=True)
    raise last_error  # type: ignore[misc]


def _die_with_parent(parent: int) -> None:
    """In the child before exec: ask Linux for SIGTERM when the parent (thread) dies."""
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the parent's own handlers still stop it
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def _terminate(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
