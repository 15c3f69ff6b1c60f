"""``splice bench publish``: what a fleet weight update costs, by number of proxies.

Starts two reference engines (the bundled tiny model) and N ``splice serve`` proxies in front of
both, then times ``trainer_bridge.publish`` (every proxy recomputes and pauses, each engine loads
once, every proxy learns the version, every proxy resumes) for each N, against the naive
protocol it replaces (pause -> update_weights -> resume on one proxy after another; the proxies
now skip an engine that already serves the version, so it too loads once per engine, but a
proxy resumes the engines before the next one has learned the version). Weights alternate between two perturbed copies of the model so every
publish really loads. Reports the median and max wall time and the loads per engine.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx


def add_parser(sub) -> None:
    p = sub.add_parser("publish", help="time of a fleet publish across N proxies sharing two engines")
    p.add_argument("--proxies", type=int, nargs="+", default=[1, 4, 16], help="fleet sizes to measure")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5, help="publishes per fleet size")
    p.add_argument("--naive", action=argparse_bool(), default=True, help="also time the one-proxy-after-another protocol")
    p.add_argument("--out")


def argparse_bool():
    import argparse

    return argparse.BooleanOptionalAction


def _start_proxy(port: int, engines: list[str], model_dir: str, tmp: Path):
    import os
    import subprocess

    from engines.reference.launch import REPO_ROOT

    args = [sys.executable, "-m", "proxy.cli", "serve", "--port", str(port), "--store", str(tmp / f"p{port}.sqlite"),
            "--tokenizer", model_dir, "--renderer", "qwen3"]
    for e in engines:
        args += ["--engine-url", e]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "SPLICE_LOG_LEVEL": "ERROR"}
    log = open(tmp / f"p{port}.log", "wb")
    proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc


def _wait_healthy(urls: list[str], procs, timeout_s: float = 240.0) -> None:
    deadline = time.monotonic() + timeout_s
    pending = set(urls)
    while pending:
        if time.monotonic() > deadline:
            raise TimeoutError(f"proxies not healthy: {sorted(pending)}")
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a proxy exited during start-up (see its log in the bench's temp dir)")
        for u in list(pending):
            try:
                if httpx.get(u + "/health", timeout=1).status_code == 200:
                    pending.discard(u)
            except httpx.HTTPError:
                pass
        time.sleep(0.2)


def _loads(engines: list[str]) -> list[int]:
    return [int(httpx.get(e + "/model_info", timeout=30).json()["weight_loads"]) for e in engines]


def _naive(urls: list[str], path: str, version: int) -> None:
    """The protocol before fleets: each proxy in turn pauses, loads every engine, resumes."""
    with httpx.Client(timeout=600) as c:
        for u in urls:
            c.post(u + "/admin/pause").raise_for_status()
            try:
                c.post(u + "/admin/update_weights", json={"model_path": path, "version": version}).raise_for_status()
            finally:
                c.post(u + "/admin/resume").raise_for_status()


def run(args) -> dict:
    from engines.reference.launch import free_port, start_engine
    from engines.reference.model_init import ensure_model, perturb_model
    from trainer_bridge.publish import publish  # the trainer's side: HTTP only

    tmp = Path(tempfile.mkdtemp(prefix="splice_bench_publish_"))
    model_dir = str(ensure_model(tmp / "tiny"))
    paths = [str(perturb_model(model_dir, tmp / f"w{k}", seed=k + 1, scale=0.05)) for k in range(2)]
    engines, stops = [], []
    results: list[dict] = []
    version = 0
    try:
        for _ in range(args.engines):
            url, stop = start_engine(model_dir, timeout_s=120)
            engines.append(url)
            stops.append(stop)
        for n in args.proxies:
            ports = [free_port() for _ in range(n)]
            urls = [f"http://127.0.0.1:{p}" for p in ports]
            procs = []
            try:
                procs = [_start_proxy(p, engines, model_dir, tmp) for p in ports]
                _wait_healthy(urls, procs)
                for u in urls:  # the proxies start at v0; bring them to the engines' version
                    httpx.post(u + "/admin/version", json={"version": version}, timeout=30).raise_for_status()
                row: dict = {"proxies": n, "engines": args.engines}
                times, phases = [], {}
                before = _loads(engines)
                for r in range(args.repeats):
                    version += 1
                    t0 = time.perf_counter()
                    rep = publish(urls, paths[version % 2], version)
                    times.append(time.perf_counter() - t0)
                    for k, v in rep.timings_s.items():
                        phases.setdefault(k, []).append(v)
                after = _loads(engines)
                row["publish_median_s"] = round(statistics.median(times), 3)
                row["publish_max_s"] = round(max(times), 3)
                row["phases_median_s"] = {k: round(statistics.median(v), 3) for k, v in phases.items()}
                row["loads_per_engine_per_publish"] = (sum(after) - sum(before)) / (len(engines) * args.repeats)
                if args.naive:
                    times = []
                    before = _loads(engines)
                    for r in range(args.repeats):
                        version += 1
                        t0 = time.perf_counter()
                        _naive(urls, paths[version % 2], version)
                        times.append(time.perf_counter() - t0)
                    after = _loads(engines)
                    row["naive_median_s"] = round(statistics.median(times), 3)
                    row["naive_loads_per_engine_per_publish"] = (sum(after) - sum(before)) / (len(engines) * args.repeats)
                results.append(row)
                _print_row(row)
            finally:
                for p in procs:
                    p.terminate()
                for p in procs:
                    try:
                        p.wait(20)
                    except Exception:  # noqa: BLE001
                        p.kill()
    finally:
        for stop in stops:
            stop()
    import os

    return {"bench": "publish", "cpu_count": os.cpu_count(), "repeats": args.repeats, "engines": args.engines,
            "model": "tiny reference Qwen3 (engines/reference)", "results": results}


def _print_row(row: dict) -> None:
    ph = row["phases_median_s"]
    line = (f"N={row['proxies']:>3}  publish median {row['publish_median_s']:.3f}s max {row['publish_max_s']:.3f}s "
            f"(status {ph.get('status', 0):.3f} pause {ph.get('pause', 0):.3f} load {ph.get('load', 0):.3f} "
            f"version {ph.get('version', 0):.3f} resume {ph.get('resume', 0):.3f})  loads/engine {row['loads_per_engine_per_publish']:.1f}")
    if "naive_median_s" in row:
        line += f"  | naive {row['naive_median_s']:.3f}s, loads/engine {row['naive_loads_per_engine_per_publish']:.1f}"
    print(line, flush=True)
