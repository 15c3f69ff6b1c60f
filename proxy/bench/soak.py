"""``splice bench soak``: a long run of the whole proxy, to see that nothing leaks or degrades.

``splice serve`` runs as its own process in front of the zero-latency engine stand-in
(``standin.py``). This process drives it in rounds: each round runs ``--sessions`` multi-turn
tool-using Chat sessions (``--turns`` turns each, ``--concurrency`` at a time, every request
carrying the whole history; ``--api responses``: Responses API sessions chained by
``previous_response_id``, so every turn expands a stored conversation), rewards every session, and meanwhile a trainer loop pulls and acks
samples and a publisher runs the weight-update protocol (pause, update_weights, resume) every
``--update-every-s`` seconds. Per round it prints turns/s, p50/p99 latency, errors and the
proxy's resident memory (RSS); the first round is the warm-up (imports, caches filling).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import orjson

from .loadgen import Conn
from .stack import REPLY_TEXT, start_splice, start_standin, stop_all, wait_http
from .tables import format_table as _table
from .workload import SYSTEM, TOOL, USER

@functools.lru_cache(maxsize=1)
def _admin() -> dict[str, str]:
    from proxy.auth import local_admin_headers

    return local_admin_headers()




def add_parser(sub) -> None:
    p = sub.add_parser("soak", help="N sessions x T turns in rounds with weight updates: throughput, latency, errors, RSS")
    p.add_argument("--rounds", type=int, default=6, help="rounds after the warm-up round")
    p.add_argument("--sessions", type=int, default=200, help="sessions per round")
    p.add_argument("--turns", type=int, default=8, help="turns per session")
    p.add_argument("--concurrency", "-c", type=int, default=32)
    p.add_argument("--update-every-s", type=float, default=2.0, help="seconds between weight updates (0: none)")
    p.add_argument("--pull-every-s", type=float, default=1.0, help="seconds between trainer pulls")
    p.add_argument("--api", choices=["chat", "responses"], default="chat",
                   help="chat: every request carries the whole history; responses: Responses API sessions chained "
                        "by previous_response_id (the stored-conversation path)")
    p.add_argument("--out")


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    return float("nan")


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Driver:
    def __init__(self, port: int, args):
        self.port, self.args = port, args
        self.version = 0
        self.updates = 0
        self.pulled = 0
        self.admin_errors: list[str] = []
        self.admin_s: dict[str, list[float]] = {}  # seconds per admin / trainer call, by path

    async def _post(self, conn: Conn, path: str, body: dict, headers: dict | None = None) -> tuple[int, bytes]:
        # the proxy's admin token for rewards, pulls and /admin (agent routes ignore it: no --api-key)
        return await asyncio.wait_for(conn.post(path, orjson.dumps(body), {**_admin(), **(headers or {})}), 60)

    async def session(self, conn: Conn, name: str, lat: list[float], errors: list[str]) -> None:
        if self.args.api == "responses":
            return await self.responses_session(conn, name, lat, errors)
        msgs: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
        headers = {"X-Session-Id": name}
        for t in range(self.args.turns):
            t0 = time.perf_counter()
            status, data = await self._post(conn, "/v1/chat/completions", {"messages": msgs, "tools": [{"type": "function", "function": TOOL}], "max_tokens": 256}, headers)
            if status != 200:
                errors.append(f"{status}: {data[:160]!r}")
                return
            lat.append(time.perf_counter() - t0)
            m = orjson.loads(data)["choices"][0]["message"]
            calls = m.get("tool_calls") or []
            msgs.append({k: v for k, v in m.items() if v is not None and k in ("role", "content", "tool_calls", "reasoning_content")})
            if not calls:
                errors.append("no tool call in the reply")
                return
            msgs.append({"role": "tool", "tool_call_id": calls[0]["id"], "content": json.dumps({"step": t, "ok": True})})
        status, data = await self._post(conn, f"/v1/sessions/{name}/reward", {"reward": float(hash(name) % 3) - 1.0})
        if status != 200:
            errors.append(f"reward {status}: {data[:160]!r}")

    async def responses_session(self, conn: Conn, name: str, lat: list[float], errors: list[str]) -> None:
        """A Responses API tool loop: each turn sends only the tool's output and the previous
        response's id, so the proxy expands the stored conversation every turn."""
        headers = {"X-Session-Id": name}
        tool = {"type": "function", **TOOL}
        body: dict = {"instructions": SYSTEM, "input": USER, "tools": [tool], "max_output_tokens": 256}
        for t in range(self.args.turns):
            t0 = time.perf_counter()
            status, data = await self._post(conn, "/v1/responses", body, headers)
            if status != 200:
                errors.append(f"{status}: {data[:160]!r}")
                return
            lat.append(time.perf_counter() - t0)
            resp = orjson.loads(data)
            calls = [o for o in resp["output"] if o["type"] == "function_call"]
            if not calls:
                errors.append("no tool call in the reply")
                return
            out = {"type": "function_call_output", "call_id": calls[0]["call_id"], "output": json.dumps({"step": t, "ok": True})}
            body = {"instructions": SYSTEM, "previous_response_id": resp["id"], "input": [out], "tools": [tool], "max_output_tokens": 256}
        status, data = await self._post(conn, f"/v1/sessions/{name}/reward", {"reward": float(hash(name) % 3) - 1.0})
        if status != 200:
            errors.append(f"reward {status}: {data[:160]!r}")

    async def round(self, tag: str) -> dict:
        lat: list[float] = []
        errors: list[str] = []
        queue: asyncio.Queue = asyncio.Queue()
        for s in range(self.args.sessions):
            queue.put_nowait(f"{tag}-{s}")

        async def worker() -> None:
            conn = Conn("127.0.0.1", self.port)
            try:
                while not queue.empty():
                    name = queue.get_nowait()
                    try:
                        await self.session(conn, name, lat, errors)
                    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError, KeyError) as e:
                        errors.append(f"{type(e).__name__}: {e}")
                        conn.close()
            finally:
                conn.close()

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(self.args.concurrency)))
        wall = time.perf_counter() - t0
        return {"turns": len(lat), "wall_s": wall, "turns_per_s": len(lat) / wall if wall else 0.0,
                "p50_ms": _pct(lat, 0.5) * 1e3, "p99_ms": _pct(lat, 0.99) * 1e3, "errors": len(errors),
                "first_errors": errors[:3]}  # fmt: skip

    async def trainer(self, stop: asyncio.Event) -> None:
        conn = Conn("127.0.0.1", self.port)
        try:
            while not stop.is_set():
                t0 = time.perf_counter()
                try:
                    status, data = await self._post(conn, "/v1/trajectories/pull", {"max_samples": 256, "wait_s": 0})
                    self.admin_s.setdefault("/v1/trajectories/pull", []).append(time.perf_counter() - t0)
                    body = orjson.loads(data) if status == 200 else {}
                    if body.get("lease_id"):
                        self.pulled += len(body["samples"])
                        await self._post(conn, "/v1/trajectories/ack", {"lease_id": body["lease_id"]})
                    elif status != 200:
                        self.admin_errors.append(f"pull {status}: {data[:160]!r}")
                except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as e:
                    self.admin_errors.append(f"pull: {type(e).__name__} after {time.perf_counter() - t0:.1f} s")
                    conn.close()
                try:
                    await asyncio.wait_for(stop.wait(), self.args.pull_every_s)
                except asyncio.TimeoutError:
                    pass
        finally:
            conn.close()

    async def publisher(self, stop: asyncio.Event) -> None:
        if self.args.update_every_s <= 0:
            return
        conn = Conn("127.0.0.1", self.port)
        try:
            while not stop.is_set():
                try:
                    await asyncio.wait_for(stop.wait(), self.args.update_every_s)
                    return
                except asyncio.TimeoutError:
                    pass
                v = self.version + 1
                for path, body in (("/admin/pause", {}), ("/admin/update_weights", {"model_path": f"/ckpt/v{v}", "version": v}), ("/admin/resume", {})):
                    t0 = time.perf_counter()
                    try:
                        status, data = await self._post(conn, path, body)
                    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as e:
                        status, data = 0, repr(e).encode()
                        conn.close()
                    self.admin_s.setdefault(path, []).append(time.perf_counter() - t0)
                    if status != 200:
                        self.admin_errors.append(f"{path} {status}: {data[:160]!r}")
                self.version = v
                self.updates += 1
        finally:
            conn.close()


def run(args) -> dict:
    from tokenization import load_tokenizer, qwen3_tokenizer_dir

    tok_dir = str(qwen3_tokenizer_dir())
    tok = load_tokenizer(tok_dir)
    out_ids = list(tok.encode(REPLY_TEXT, add_special_tokens=False))
    procs: list[subprocess.Popen] = []
    tmp = tempfile.mkdtemp(prefix="splice_bench_soak_")
    try:
        surl = start_standin(tmp, tok, out_ids, procs)
        pport = start_splice(tmp, surl, tok_dir, procs, ["--max-context", "32768"])
        splice = procs[-1]
        if why := wait_http(f"http://127.0.0.1:{pport}/v1/models", splice):
            raise SystemExit(f"splice serve: {why}")

        driver = Driver(pport, args)
        rows: list[dict] = []
        rss_start = _rss_mb(splice.pid)

        async def main() -> None:
            stop = asyncio.Event()
            side = [asyncio.create_task(driver.trainer(stop)), asyncio.create_task(driver.publisher(stop))]
            for r in range(args.rounds + 1):
                res = await driver.round(f"r{r}")
                res.update(round="warm-up" if r == 0 else str(r), rss_mb=_rss_mb(splice.pid), version=driver.version)
                rows.append(res)
                print(f"round {res['round']}: {res['turns']} turns, {res['turns_per_s']:.0f} turns/s, p50 {res['p50_ms']:.1f} ms, "
                      f"p99 {res['p99_ms']:.1f} ms, {res['errors']} errors, RSS {res['rss_mb']:.0f} MB", flush=True)  # fmt: skip
            stop.set()
            await asyncio.gather(*side)

        asyncio.run(main())
        measured = rows[1:] or rows
        total_turns = sum(r["turns"] for r in measured)
        total_wall = sum(r["wall_s"] for r in measured)
        summary = {
            "api": args.api, "sessions_per_round": args.sessions, "turns_per_session": args.turns, "concurrency": args.concurrency,
            "rounds": args.rounds, "turns": total_turns, "turns_per_s": total_turns / total_wall if total_wall else 0.0,
            "p50_ms": statistics.median(r["p50_ms"] for r in measured), "p99_ms": max(r["p99_ms"] for r in measured),
            "errors": sum(r["errors"] for r in rows), "admin_errors": driver.admin_errors[:5], "weight_updates": driver.updates,
            "samples_pulled": driver.pulled, "rss_start_mb": rss_start, "rss_after_warmup_mb": rows[0]["rss_mb"],
            "rss_end_mb": rows[-1]["rss_mb"], "store_bytes": os.path.getsize(os.path.join(tmp, "splice.sqlite")),
            "admin_calls_s": {p: {"n": len(xs), "p50": _pct(xs, 0.5), "max": max(xs)} for p, xs in driver.admin_s.items()},
        }  # fmt: skip
        print()
        print(_table(["round", "turns", "turns/s", "p50 ms", "p99 ms", "errors", "RSS MB", "version"],
                     [[r["round"], r["turns"], f"{r['turns_per_s']:.0f}", f"{r['p50_ms']:.1f}", f"{r['p99_ms']:.1f}",
                       r["errors"], f"{r['rss_mb']:.0f}", r["version"]] for r in rows]))  # fmt: skip
        print(
            f"\n{summary['turns']} turns after warm-up: {summary['turns_per_s']:.0f} turns/s, p50 {summary['p50_ms']:.1f} ms, "
            f"p99 {summary['p99_ms']:.1f} ms, {summary['errors']} errors, {summary['weight_updates']} weight updates, "
            f"{summary['samples_pulled']} samples pulled; RSS {summary['rss_start_mb']:.0f} MB at start, "
            f"{summary['rss_after_warmup_mb']:.0f} MB after warm-up, {summary['rss_end_mb']:.0f} MB at the end"
        )
        for path, st in summary["admin_calls_s"].items():
            print(f"{path}: {st['n']} calls, p50 {st['p50']:.2f} s, max {st['max']:.2f} s")
        if driver.admin_errors:
            print("admin errors:", driver.admin_errors[:3])
        return {"summary": summary, "rounds": rows}
    finally:
        stop_all(procs)
