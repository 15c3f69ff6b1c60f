"""A sampling profile of a running proxy: ``py-spy record`` (collapsed stacks) around a bench
phase, and its hottest frames as a table.

py-spy is not a dependency (``pip install py-spy``); it is found at ``$PY_SPY``, on ``PATH`` or beside
this interpreter (a venv not activated).
Attaching needs ptrace permission over the proxy (same user, ``kernel.yama.ptrace_scope`` 0 or
1 with the proxy a child of the caller's parent, or root).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from typing import Iterator

from .tables import format_table


def _py_spy() -> str:
    # pip installs it beside this interpreter, which need not be on PATH (a venv not activated)
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    exe = os.environ.get("PY_SPY") or shutil.which("py-spy") or (beside if os.path.exists(beside) else None)
    if not exe:
        raise SystemExit("--profile needs py-spy: pip install py-spy (or set PY_SPY to its path)")
    if not os.access(exe, os.X_OK):
        raise SystemExit(f"--profile: {exe} is not executable (chmod +x it)")
    return exe


def start_profile(pid: int, out: str, rate: int = 250, *, gil: bool = False) -> subprocess.Popen:
    """``py-spy record`` on ``pid`` until :func:`stop_profile`; collapsed stacks to ``out``.

    ``gil``: only samples of the thread holding the GIL, i.e. Python's own work and the native
    code it calls without releasing the GIL (orjson, numpy, socket writes). What releases the GIL
    (SQLite statements, hashing large buffers, the tokenizer's Rust code) is left out. Without
    it py-spy decides from the OS thread state, which in a VM counts some waits as work."""
    cmd = [_py_spy(), "record", "--pid", str(pid), "--rate", str(rate), "--format", "raw", "--output", out, "--nonblocking"]
    if gil:
        cmd.append("--gil")
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def stop_profile(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def _frame(raw: str) -> str:
    """``func (path/to/module.py:123)`` -> ``module.py:func``."""
    name, _, where = raw.partition(" (")
    path = where.rsplit(":", 1)[0]
    parts = path.split("/")
    short = "/".join(parts[-2:]) if parts[-1] in ("__init__.py", "main.py", "base.py", "routing.py") else parts[-1]
    return f"{short}:{name}" if where else name


def _idle(last: str) -> bool:
    """A sample of a thread waiting, not working: the event loop in ``select`` (or inside
    uvloop's native loop, where Python frames stop at ``asyncio.run``) or a pool thread waiting
    for work. py-spy cannot always tell from the OS thread state in a VM."""
    name = last.partition(" (")[0]
    return name in ("select", "poll") or last.startswith("run (asyncio/runners.py") or (
        name == "_worker" and "concurrent/futures/thread.py" in last and "run (" not in last)


# Where a sample's time goes, named by the innermost frame that belongs to a known part (a
# sample inside orjson called from the engine client is the engine client's).
PARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("engine client", ("/engines/", "aiohttp/", "httpx/", "httpcore/", "h11/", "anyio/")),
    ("store", ("/proxy/store/", "sqlite3/")),
    ("tokenization", ("/tokenization/", "renderers/", "tokenizers/", "transformers/")),
    ("dialect (request checks, response JSON)", ("/proxy/api/", "pydantic/", "pydantic_core/")),
    ("session logic (planner, runner, drift, R2)", ("/proxy/session/",)),
    ("HTTP serving (uvicorn, Starlette, FastAPI, guard)", ("uvicorn/", "starlette/", "fastapi/", "/proxy/guard.py",
                                                          "/proxy/ui/", "/proxy/app")),  # fmt: skip
    ("metrics and logging", ("prometheus_client/", "logging/", "/proxy/metrics", "/proxy/turn_log")),
)


def part_of(raw_frames: list[str]) -> str:
    """The part a sample belongs to: the innermost frame whose file matches one of ``PARTS``."""
    for raw in reversed(raw_frames):
        where = "/" + raw.partition(" (")[2]
        for name, keys in PARTS:
            if any(k in where for k in keys):
                return name
    return "other (event loop, threads)"


def busy_samples(path: str) -> Iterator[tuple[list[str], int]]:
    """(raw frames below the thread name, count) of each busy stack in a collapsed-stack file
    (waiting threads dropped)."""
    with open(path, encoding="utf-8", errors="replace") as f:  # py-spy may read a frame mid-update
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if not stack or not n.isdigit():
                continue
            raw = stack.split(";")
            if _idle(raw[-1]) or len(raw) < 2:  # first entry: the thread
                continue
            yield raw[1:], int(n)


def by_part(path: str) -> tuple[int, Counter]:
    """(busy samples, samples per part) from a collapsed-stack file."""
    total, parts = 0, Counter()
    for raw, k in busy_samples(path):
        total += k
        parts[part_of(raw)] += k
    return total, parts


def summarize(path: str) -> tuple[int, Counter, Counter]:
    """(samples, inclusive, self) counts per frame from a collapsed-stack file (idle threads dropped)."""
    total, incl, own = 0, Counter(), Counter()
    for raw, k in busy_samples(path):
        frames = [_frame(x) for x in raw]
        total += k
        for fr in set(frames):
            incl[fr] += k
        own[frames[-1]] += k
    return total, incl, own


def top_frames(path: str, n: int = 25) -> str:
    """The ``n`` frames with the most samples under them (inclusive) and where samples land (self)."""
    try:
        total, incl, own = summarize(path)
    except OSError as exc:
        return f"profile {path}: {exc}"
    if not total:
        return f"profile {path}: no busy samples"
    rows = [[fr, f"{100 * k / total:.1f}"] for fr, k in incl.most_common(n)]
    rows2 = [[fr, f"{100 * k / total:.1f}"] for fr, k in own.most_common(n)]
    _, parts = by_part(path)
    rows3 = [[name, f"{100 * k / total:.1f}"] for name, k in parts.most_common()]
    return (f"\nprofile {path}: {total} busy samples\n" + format_table(["part of the proxy", "%"], rows3)
            + "\n\n" + format_table(["frame (inclusive)", "%"], rows)
            + "\n\n" + format_table(["frame (self)", "%"], rows2))
