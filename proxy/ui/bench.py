"""How long the viewer takes to open a long session: ``python -m proxy.ui.bench``.

Builds a session of about ``--tokens`` tokens in a fresh store (real Qwen3 tokenizer and
template tokens; a long tool result between two turns; the second turn's output spans a weight
update), serves it with ``splice``'s app on loopback, and opens ``/ui/#/s/<id>`` in headless
Chromium (Debian's ``chromium`` and ``chromium-driver``, driven by Selenium: the dev extra).
Prints a table: the first open (nothing cached) and the next ones, each as the time from
navigation to the first page of tokens on screen, and the two JSON requests behind it.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np


def build_session(store_path: str, tokens: int, session_id: str = "long") -> int:
    """A two-turn session of about ``tokens`` tokens written straight into a store; returns its length."""
    from tokenization import load_tokenizer, qwen3_tokenizer_dir

    from ..store import Store, TurnRecord

    tok = load_tokenizer(str(qwen3_tokenizer_dir()))
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    rng = np.random.default_rng(0)
    prompt0 = enc("<|im_start|>user\nSummarize big.py.<|im_end|>\n<|im_start|>assistant\n")
    out0 = enc('<think>I should read it.</think>\n<tool_call>\n{"name": "read_file", "arguments": {"path": "big.py"}}\n</tool_call><|im_end|>')
    words = ["alpha", "beta", "kernel", "def", "return", "{", "}", "0x1f", "tensor", "# note", "self.x", "==", "\n"]
    body: list[int] = []
    while len(body) < tokens - 400:
        body += enc(" ".join(rng.choice(words, 4000).tolist()))
    body = body[: tokens - 400]
    tail = enc("\n<|im_start|>user\n<tool_response>\n") + body + enc("\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    out1 = enc("The file defines a kernel and returns a tensor; " * 6 + "that is all.<|im_end|>")
    half = len(out1) // 2

    def lp(n: int, base: float) -> list[float]:
        return (base - rng.random(n) * 2).astype(np.float32).tolist()

    store = Store(store_path)
    try:
        store.sessions.upsert(session_id, group_id="bench")
        lp1 = lp(len(out1), -0.1)
        turns = [
            TurnRecord("bench-t0", session_id, 0, None, prompt0, out0, lp(len(out0), -0.2), [0] * len(out0),
                       lp(len(out0), -0.2), [1] * len(out0), False, None, "tool_calls", time.time(), {}, False, "chat", "r0"),
            TurnRecord("bench-t1", session_id, 1, "bench-t0", prompt0 + out0 + tail, out1, lp1, [0] * half + [1] * (len(out1) - half),
                       [x + 0.05 for x in lp1[:half]] + lp1[half:], [1] * len(out1), True, None, "stop", time.time(), {}, False, "chat", "r1"),
        ]  # fmt: skip
        for t in turns:
            store.turns.add(t)
        return len(prompt0 + out0 + tail + out1)
    finally:
        store.close()


class IdlePool:
    """An engine pool stand-in for reading stored sessions: it never samples."""

    def __init__(self):
        from engines.types import EngineInfo

        self.version = 1
        self.paused = False
        self.info = EngineInfo()

    async def start(self):
        pass

    async def close(self):
        pass

    def status(self):
        return {"in_flight": 0}


def serve(store_path: str, port: int):
    """The proxy app on loopback in a thread (an engine stand-in that never samples here)."""
    import uvicorn

    from tokenization import ChatFormat, load_tokenizer, qwen3_tokenizer_dir

    from ..app import create_app
    from ..settings import Settings

    tok = load_tokenizer(str(qwen3_tokenizer_dir()))
    app = create_app(Settings(store=store_path), fmt=ChatFormat(tok, "qwen3"), pool=IdlePool())
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return server, th
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError("the app did not start")


def open_times(url: str, session_id: str, runs: int, chromium: str, chromedriver: str) -> list[dict]:
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="splice-bench-chromium-")
    opts = Options()
    opts.binary_location = chromium
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage", "--window-size=1400,1000",
                 f"--user-data-dir={profile}"):  # fmt: skip
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(chromedriver), options=opts)
    out = []
    try:
        for k in range(runs):
            driver.get("about:blank")
            t0 = time.perf_counter()
            driver.get(f"{url}/ui/#/s/{session_id}")
            while driver.execute_script("return document.body && document.body.dataset.ready") != "1":
                time.sleep(0.005)
            wall = time.perf_counter() - t0
            nav = driver.execute_script("return window.spliceDrawnAt")
            draw = driver.execute_script("return window.spliceDrawMs")
            dcl = driver.execute_script("return performance.getEntriesByType('navigation')[0].domContentLoadedEventEnd")
            timing = driver.execute_script(
                "return performance.getEntriesByType('resource').filter(e => e.name.includes('/ui/api/'))"
                ".map(e => [e.name.split('/ui/api/')[1].split('?')[0], e.duration])"
            )
            cells = driver.execute_script("return document.querySelectorAll('.strip .c').length")
            out.append({"run": k, "wall_ms": wall * 1000, "page_ms": nav, "open_ms": driver.execute_script("return window.spliceOpenMs"),
                        "api": {name: ms for name, ms in timing}, "cells": cells, "draw_ms": draw, "dcl_ms": dcl})  # fmt: skip
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
    return out


def build_table(store_path: str, n_sessions: int) -> None:
    """``n_sessions`` sessions of two turns each, written with plain inserts (fast to build);
    one in 1,000 has a ``tools_changed`` fork and a third more a ``history_edited`` one, one in
    4 an image, one in 10 a reward, versions grow with creation time. Episode roles: half add a
    side call (a third turn, ``auxiliary``), one in 5,000 starts with a sub-agent's turn, one in
    50,000 holds only a compacted restart."""
    from ..store import Store
    from ..store.packing import pack_runs

    store = Store(store_path)
    try:
        with store.db.write() as c:
            sampling = c.execute("INSERT INTO samplings (json) VALUES (?)", (b'{"engine_id":"http://engine-a:30000"}',)).lastrowid
            out = np.arange(100, 164, dtype=np.int32).tobytes()
            lps = np.full(64, -0.5, np.float32).tobytes()
            sessions, turns, images = [], [], []
            for k in range(n_sessions):
                sid = f"s{k:07d}"
                v = k * 20 // n_sessions
                sessions.append((sid, f"g{k // 8}", 8, 1.0 if k % 10 == 0 else None, int(k % 10 == 0), 1e9 + k))
                roles = ["compacted"] if k % 50_000 == 1 else ["subagent", "main"] if k % 5000 == 0 else ["main", "main"]
                roles += ["auxiliary"] if k % 2 == 0 else []
                for i, role in enumerate(roles):
                    fork = ("tools_changed" if k % 1000 == 0 else "history_edited" if k % 3 == 1 else None) if i == 1 else None
                    turns.append((f"{sid}-t{i}", sid, i, f"{sid}-t0" if i == 1 else None, None, 0, out, 200, 64, out, lps,
                                  pack_runs(np.full(64, v, np.int32)), int(i == 1 and not fork), fork, "stop", 1e9 + k + i / 3,
                                  sampling, 0, "chat", f"r{sid}-{i}", role))  # fmt: skip
                    if i == 0 and k % 4 == 0:
                        images.append(f"{sid}-t0")
            c.executemany("INSERT INTO sessions (session_id, group_id, group_size, reward, closed, created_at) VALUES (?,?,?,?,?,?)", sessions)
            c.executemany(
                "INSERT INTO turns (turn_id, session_id, idx, parent_turn_id, prompt_base, prompt_base_len, prompt_tail, n_prompt, "
                "n_output, output_ids, logprobs, versions, spliced, fork_reason, finish_reason, created_at, sampling_id, drift, "
                "api, response_id, role) VALUES (" + ",".join("?" * 21) + ")", turns)  # fmt: skip
            c.executemany("INSERT INTO turn_images (turn_seq, refs) SELECT seq, x'' FROM turns WHERE turn_id = ?", [(t,) for t in images])
    finally:
        store.close()


def table_times(store_path: str, reps: int = 5) -> list[tuple[str, float, int]]:
    """Milliseconds per sessions-table page (median of ``reps``), per filter."""
    from ..store import Store
    from .queries import SessionFilter, list_sessions

    store = Store(store_path)
    try:
        deep = None
        for _ in range(100):  # the cursor of page 101
            deep = list_sessions(store.db, SessionFilter(), version=20, cursor=deep, limit=50)["next_cursor"]
        cases = [
            ("first page, no filter", SessionFilter(), None),
            ("page 101, no filter", SessionFilter(), deep),
            ("rewarded", SessionFilter(rewarded=True), None),
            ("one group", SessionFilter(group_id="g42"), None),
            ("fork reason (1 in 1,000)", SessionFilter(fork_reason="tools_changed"), None),
            ("fork reason (1 in 3)", SessionFilter(fork_reason="history_edited"), None),
            ("any fork", SessionFilter(fork_reason="*"), None),
            ("has images (1 in 4)", SessionFilter(has_images=True), None),
            ("no images", SessionFilter(has_images=False), None),
            ("role main", SessionFilter(role="main"), None),
            ("role auxiliary (1 in 2)", SessionFilter(role="auxiliary"), None),
            ("role subagent (1 in 5,000)", SessionFilter(role="subagent"), None),
            ("role compacted (1 in 50,000)", SessionFilter(role="compacted"), None),
            ("role aux. and rewarded", SessionFilter(role="auxiliary", rewarded=True), None),
            ("engine", SessionFilter(engine="engine-a"), None),
            ("versions 3-4 (old)", SessionFilter(version_min=3, version_max=4), None),
        ]
        out = []
        for name, f, cursor in cases:
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                rows = list_sessions(store.db, f, version=20, cursor=cursor, limit=50)["data"]
                times.append((time.perf_counter() - t0) * 1000)
            out.append((name, statistics.median(times), len(rows)))
        return out
    finally:
        store.close()


def main(argv: list[str] | None = None) -> int:
    from engines.reference.launch import free_port

    ap = argparse.ArgumentParser(prog="python -m proxy.ui.bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=100_000, help="tokens of the session opened in Chromium (0: skip it)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    ap.add_argument("--chromedriver", default="/usr/bin/chromedriver")
    ap.add_argument("--sessions", type=int, default=100_000, help="sessions in the table benchmark (0: skip it)")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="splice-ui-bench-"))
    try:
        if args.sessions:
            build_table(str(tmp / "table.sqlite"), args.sessions)
            print(f"sessions table, {args.sessions} sessions of two or three turns, pages of 50")
            print(f"{'filter':<28}{'ms per page':>12}{'rows':>6}")
            for name, ms, rows in table_times(str(tmp / "table.sqlite")):
                print(f"{name:<28}{ms:>12.1f}{rows:>6}")
            print()
        if not args.tokens:
            return 0
        store = str(tmp / "s.sqlite")
        n = build_session(store, args.tokens)
        port = free_port()
        server, th = serve(store, port)
        try:
            runs = open_times(f"http://127.0.0.1:{port}", "long", args.runs, args.chromium, args.chromedriver)
        finally:
            server.should_exit = True
            th.join(10)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"session of {n} tokens (one sample); tokens on the page when the figures were read: {runs[0]['cells']} "
          "(512 when it opens, 2,048 more while the end is in view)")
    print(f"{'open':<8}{'navigation -> drawn (ms)':>26}{'session JSON (ms)':>19}{'first page JSON (ms)':>22}{'last page drawn (ms)':>22}{'page loaded (ms)':>18}")
    for r in runs:
        print(f"{'first' if r['run'] == 0 else 'again':<8}{r['page_ms']:>26.0f}{r['api'].get('session', float('nan')):>19.0f}"
              f"{r['api'].get('tokens', float('nan')):>22.0f}{r['draw_ms']:>22.0f}{r['dcl_ms']:>18.0f}")  # fmt: skip
    later = [r["page_ms"] for r in runs[1:]] or [runs[0]["page_ms"]]
    print(f"first open: {runs[0]['page_ms']:.0f} ms; later opens: median {statistics.median(later):.0f} ms, "
          f"fastest {min(later):.0f} ms, slowest {max(later):.0f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
