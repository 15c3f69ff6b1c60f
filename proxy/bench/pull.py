"""``splice bench pull``: the trainer pull at 1k / 10k / 100k tokens per sample, JSON vs Arrow.

For each size one rewarded agent session (turns of ``--turn-tokens`` tokens: tool output then a
sampled answer, ``--sampled`` of them sampled, a version change every 10 turns, half the tokens
recomputed) is stored and served by the real training routes in a child process (uvicorn,
loopback). Each format is pulled ``--reps`` times (the lease timeout is tiny, so every pull gets
the sample again) and the best run is reported (the JSON file has medians too). Reported: bytes
per token on the wire; seconds to serve (request until the last byte arrived); seconds to parse (JSON: ``orjson.loads`` into Python lists, as trainers read
it so far; Arrow: ``trainer_bridge.client.read_arrow_samples`` into NumPy arrays); and the peak
RSS of the proxy and of a trainer process for one 100k-token sample (fresh processes; the
second pull's peak above the RSS before it, the kernel's peak mark reset in between). Token ids are uniform over a 151k vocabulary: the hardest case for the
Arrow stream's compression.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from .tables import format_table as _table

VOCAB = 151_000


def build_store(path: str, n_tokens: int, *, turn_tokens: int, sampled: float, seed: int = 0) -> tuple[int, float]:
    """One rewarded session whose sample has ``n_tokens`` tokens, then a 100-token "warm" session
    rewarded later (for warm-up reads, ``GET /v1/trajectories/samples?since=``); returns the
    exact token count and the warm session's reward time."""
    from .. import store as store_mod
    from ..store.records import TurnRecord

    rng = np.random.default_rng(seed)
    turns = max(1, round(n_tokens / turn_tokens))
    out_len = max(1, round(turn_tokens * sampled))
    ctx_len = turn_tokens - out_len
    with store_mod.Store(path) as st:
        st.sessions.upsert("bench", group_id=None, group_size=None)
        prompt = rng.integers(0, VOCAB, ctx_len).tolist()
        for k in range(turns):
            out = rng.integers(0, VOCAB, out_len).tolist()
            lp = (-rng.gamma(1.2, 0.6, out_len)).astype(np.float32).tolist()
            v = [k // 10] * out_len
            rec = TurnRecord(
                f"bench-t{k}", "bench", k, f"bench-t{k - 1}" if k else None, prompt, out, lp, v, lp, v, k > 0, None,
                "stop", time.time(), {"used": {"temperature": 1.0, "top_p": 1.0, "top_k": -1}, "model": "bench",
                                      "engine_id": "http://127.0.0.1:30000", "trainable": True},
                False, "chat", f"resp-bench-{k}",
            )  # fmt: skip
            st.turns.add(rec)
            if k % 2:  # half the turns recomputed under the next version
                st.turns.update_proximal(rec.turn_id, (np.asarray(lp) - 0.05).tolist(), [x + 1 for x in v])
            prompt = prompt + out + rng.integers(0, VOCAB, ctx_len if k + 1 < turns else 0).tolist()
        st.sessions.set_reward("bench", 1.0)
        time.sleep(0.01)
        st.sessions.upsert("warm", group_id=None, group_size=None)
        st.turns.add(TurnRecord("warm-t0", "warm", 0, None, list(range(80)), list(range(20)), [-1.0] * 20, [0] * 20,
                                [-1.0] * 20, [0] * 20, False, None, "stop", time.time(), {}, False, "chat", "resp-warm"))  # fmt: skip
        warm = st.sessions.set_reward("warm", 1.0)
        return len(prompt), warm.rewarded_at


def rss_mb() -> dict[str, float]:
    """This process's resident memory now and its peak since the last ``reset_peak`` (Linux)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) / 1024
    return {"rss_mb": out["VmRSS"], "peak_mb": out["VmHWM"]}


def reset_peak() -> None:
    """Reset the kernel's peak-RSS mark to the current RSS (``/proc/self/clear_refs``, Linux)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _serve(store_path: str, port: int) -> None:
    """The child: the real training routes over one store, plus its own peak RSS."""
    from types import SimpleNamespace

    import uvicorn
    from fastapi import FastAPI

    from ..api.training import training_router
    from ..metrics import Metrics
    from ..session import RecomputeScheduler
    from ..store import Store

    store = Store(store_path)
    app = FastAPI()
    engines = SimpleNamespace(paused=False, version=0)
    app.include_router(training_router(store, RecomputeScheduler(store, engines, Metrics()), SimpleNamespace(lease_timeout_s=1e-6)))

    @app.get("/bench/rss")
    def rss():
        return rss_mb()

    @app.post("/bench/reset_peak")
    def reset():
        reset_peak()
        return rss_mb()

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


class Server:
    def __init__(self, store_path: str):
        from engines.reference.launch import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"from proxy.bench.pull import _serve; _serve({store_path!r}, {self.port})"],
            env={**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])},
        )
        import httpx

        deadline = time.time() + 60
        while True:
            try:
                httpx.get(self.url + "/bench/rss", timeout=2)
                break
            except httpx.TransportError:
                if time.time() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("the bench server did not start")
                time.sleep(0.1)

    def rss(self) -> dict[str, float]:
        import httpx

        return httpx.get(self.url + "/bench/rss", timeout=10).json()

    def reset_peak(self) -> dict[str, float]:
        import httpx

        return httpx.post(self.url + "/bench/reset_peak", timeout=10).json()

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _warm(url: str, arrow: bool, since: float) -> None:
    """Read the small warm session through the same routes and parser (imports, first allocations)."""
    import httpx

    from proxy.auth import local_admin_headers

    headers = {"Accept": "application/vnd.apache.arrow.stream"} if arrow else {}
    headers.update(local_admin_headers())
    r = httpx.get(url + "/v1/trajectories/samples", params={"since": repr(since)}, headers=headers, timeout=60)
    r.raise_for_status()
    _parse(r.content, arrow)


def _pull(url: str, arrow: bool) -> tuple[bytes, float]:
    import httpx

    from proxy.auth import local_admin_headers

    headers = {"Accept": "application/vnd.apache.arrow.stream"} if arrow else {}
    headers.update(local_admin_headers())
    t = time.perf_counter()
    r = httpx.post(url + "/v1/trajectories/pull", json={"max_samples": 1}, headers=headers, timeout=600)
    r.raise_for_status()
    return r.content, time.perf_counter() - t


def _parse(content: bytes, arrow: bool) -> tuple[int, float]:
    import orjson

    from trainer_bridge.client import read_arrow_samples

    gc.collect()  # neither format pays for the other's garbage
    t = time.perf_counter()
    if arrow:
        _, samples = read_arrow_samples(content)
    else:
        samples = orjson.loads(content)["samples"]
    dt = time.perf_counter() - t
    return len(samples[0]["input_ids"]), dt


def _trainer_rss(url: str, arrow: bool) -> dict[str, float]:
    """A fresh trainer process pulls the sample twice with ProxyClient (the first pull pays the
    one-time costs); the second pull's peak RSS above the RSS before it, and the peak itself."""
    code = (
        "import json\n"
        "from trainer_bridge.client import ProxyClient\n"
        "from proxy.bench.pull import rss_mb, reset_peak\n"
        f"c = ProxyClient({url!r}, arrow={arrow})\n"
        "lease, s = c.pull(1)\n"
        "del s\n"
        "reset_peak()\n"
        "before = rss_mb()['rss_mb']\n"
        "lease, s = c.pull(1)\n"
        "after = rss_mb()\n"
        "print(json.dumps({'growth_mb': after['peak_mb'] - before, 'peak_mb': after['peak_mb'], 'n': len(s[0]['input_ids'])}))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> dict:
    rows, results = [], []
    cases = [(n, args.sampled) for n in args.sizes] + ([(max(args.sizes), 1.0)] if args.sampled < 1.0 else [])
    with tempfile.TemporaryDirectory() as tmp:
        for n, sampled in cases:
            path = os.path.join(tmp, f"s{n}_{sampled}.sqlite")
            tokens, since = build_store(path, n, turn_tokens=args.turn_tokens, sampled=sampled)
            server = Server(path)
            try:
                res = {"tokens": tokens, "sampled": sampled}
                for arrow in (False, True):
                    name = "arrow" if arrow else "json"
                    _warm(server.url, arrow, since)
                    _pull(server.url, arrow)
                    serve_s, parse_s, size = [], [], 0
                    for _ in range(args.reps):
                        content, s = _pull(server.url, arrow)
                        got, p = _parse(content, arrow)
                        assert got == tokens, (got, tokens)
                        serve_s.append(s)
                        parse_s.append(p)
                        size = len(content)
                    # best of --reps: the machine is shared, the minimum is the least disturbed run
                    res[name] = {"bytes_per_token": size / tokens, "serve_s": min(serve_s), "parse_s": min(parse_s),
                                 "serve_s_median": statistics.median(serve_s), "parse_s_median": statistics.median(parse_s)}
                results.append(res)
                j, a = res["json"], res["arrow"]
                rows.append([f"{tokens:,}", f"{sampled:.0%}", f"{j['bytes_per_token']:.1f}", f"{a['bytes_per_token']:.1f}",
                             f"{j['serve_s'] * 1e3:.1f}", f"{a['serve_s'] * 1e3:.1f}", f"{j['parse_s'] * 1e3:.2f}",
                             f"{a['parse_s'] * 1e3:.2f}", f"{j['parse_s'] / a['parse_s']:.0f}x"])  # fmt: skip
            finally:
                server.close()
        print(_table(["tokens", "sampled", "B/tok json", "B/tok arrow", "serve ms json", "serve ms arrow",
                      "parse ms json", "parse ms arrow", "parse speed-up"], rows))  # fmt: skip

        n = max(args.sizes)
        path = os.path.join(tmp, "rss.sqlite")
        tokens, since = build_store(path, n, turn_tokens=args.turn_tokens, sampled=args.sampled)
        rss = {"tokens": tokens}
        for arrow in (False, True):
            name = "arrow" if arrow else "json"
            server = Server(path)
            try:
                _pull(server.url, arrow)  # the first pull pays one-time costs (imports, allocator arenas)
                before = server.reset_peak()["rss_mb"]
                _pull(server.url, arrow)
                after = server.rss()
                rss[f"proxy_{name}_growth_mb"] = after["peak_mb"] - before
                rss[f"proxy_{name}_peak_mb"] = after["peak_mb"]
                t = _trainer_rss(server.url, arrow)
                rss[f"trainer_{name}_growth_mb"] = t["growth_mb"]
                rss[f"trainer_{name}_peak_mb"] = t["peak_mb"]
            finally:
                server.close()
        print(f"\none {tokens:,}-token sample, peak RSS above the RSS before the pull (process peak):")
        print(_table(["process", "JSON MB", "Arrow MB"], [
            [who, f"{rss[f'{who}_json_growth_mb']:.1f} ({rss[f'{who}_json_peak_mb']:.0f})",
             f"{rss[f'{who}_arrow_growth_mb']:.1f} ({rss[f'{who}_arrow_peak_mb']:.0f})"] for who in ("proxy", "trainer")
        ]))  # fmt: skip
    return {"results": results, "rss_one_sample": rss, "turn_tokens": args.turn_tokens, "reps": args.reps}


def add_parser(sub) -> None:
    p = sub.add_parser("pull", help="the trainer pull: bytes per token and serve/parse time, JSON vs Arrow")
    p.add_argument("--sizes", type=int, nargs="+", default=[1_000, 10_000, 100_000], help="tokens per sample")
    p.add_argument("--turn-tokens", type=int, default=1000, help="tokens per turn (tool output + sampled answer)")
    p.add_argument("--sampled", type=float, default=0.2, help="fraction of each turn's tokens the policy sampled")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--out")
