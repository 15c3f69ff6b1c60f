"""``splice bench publish``: what a fleet weight update costs, by number of proxies.

Starts two reference engines (the bundled tiny model) and N ``splice serve`` proxies in front of
both, then times ``trainer_bridge.publish`` (every proxy recomputes and pauses, each engine loads
once, every proxy learns the version, every proxy resumes) for each N, against the naive
protocol it replaces (pause -> update_weights -> resume on one proxy after another; the proxies
now skip an engine that already serves the version, so it too loads once per engine, but a
proxy resumes the engines before the next one has learned the version). Weights alternate between two perturbed copies of the model so every
publish really loads. Reports the median and max wall time and the loads per engine.

``--transfer disk|distributed|both`` measures the other axis instead: seconds per GB of weights
for a model of about 1 GB (a wider reference Qwen3, float32), one engine behind one proxy. disk:
the trainer saves a safetensors directory and the engine loads it (``publish``); distributed:
the trainer broadcasts the tensors over ``torch.distributed`` (gloo on this CPU machine) and the
engine loads them as they arrive (``publish_tensors``; the process group is made by the first
publish and kept). docs/weight_transfer.md has the figures and the NCCL arithmetic.
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
    p.add_argument("--transfer", choices=("disk", "distributed", "both"), default=None,
                   help="instead: seconds per GB for a ~1 GB model, from disk vs broadcast over torch.distributed")
    p.add_argument("--hidden-size", type=int, default=1024, help="--transfer: width of the model (1024: about 0.9 GB)")
    p.add_argument("--layers", type=int, default=6, help="--transfer: layers of the model")
    p.add_argument("--bucket-mb", type=float, default=512.0, help="--transfer distributed: megabytes per update call")


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
    from proxy.auth import local_admin_headers

    with httpx.Client(timeout=600, headers=local_admin_headers()) as c:
        for u in urls:
            c.post(u + "/admin/pause").raise_for_status()
            try:
                c.post(u + "/admin/update_weights", json={"model_path": path, "version": version}).raise_for_status()
            finally:
                c.post(u + "/admin/resume").raise_for_status()


def run(args) -> dict:
    if getattr(args, "transfer", None):
        return run_transfer(args)
    from engines.reference.launch import free_port, start_engine
    from engines.reference.model_init import ensure_model, perturb_model
    from trainer_bridge.publish import publish  # the trainer's side: HTTP only

    from proxy.auth import local_admin_headers

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
                    httpx.post(u + "/admin/version", json={"version": version}, headers=local_admin_headers(), timeout=30).raise_for_status()
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


def run_transfer(args) -> dict:
    """Seconds per GB, disk vs broadcast, for one ~1 GB model (module docstring)."""
    import os

    import torch
    from safetensors.torch import save_file

    from engines.reference.launch import free_port, start_engine
    from engines.reference.model_init import init_model
    from trainer_bridge.publish import publish, publish_tensors
    from trainer_bridge.weight_transfer import WeightSender, safetensors_tensors

    tmp = Path(tempfile.mkdtemp(prefix="splice_bench_transfer_"))
    h = int(args.hidden_size)
    model_dir = str(init_model(tmp / "model", hidden_size=h, num_layers=args.layers, num_heads=max(1, h // 64),
                               num_kv_heads=max(1, h // 128), head_dim=64, intermediate_size=3 * h))
    base = dict(safetensors_tensors(model_dir))
    gen = torch.Generator().manual_seed(7)
    versions = [base, {k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in base.items()}]  # two in memory
    gb = sum(t.numel() * t.element_size() for t in base.values()) / 1e9
    modes = ["disk", "distributed"] if args.transfer == "both" else [args.transfer]
    results: list[dict] = []
    url, stop = start_engine(model_dir, timeout_s=600)
    port = free_port()
    proxy_url = f"http://127.0.0.1:{port}"
    proc = _start_proxy(port, [url], model_dir, tmp)
    sender = WeightSender(master_address="127.0.0.1", backend="gloo", timeout_s=600)
    version = 0
    try:
        _wait_healthy([proxy_url], [proc])
        for mode in modes:
            times, extra = [], []
            for r in range(args.repeats + (1 if mode == "distributed" else 0)):
                version += 1
                tensors = versions[version % 2]
                if mode == "disk":
                    out = tmp / f"v{version}"
                    out.mkdir()
                    t0 = time.perf_counter()
                    save_file(tensors, str(out / "model.safetensors"))  # what the trainer writes each step
                    t1 = time.perf_counter()
                    publish([proxy_url], str(out), version)
                    t2 = time.perf_counter()
                    times.append(t2 - t0)
                    extra.append({"save_s": t1 - t0, "load_s": t2 - t1})
                    for f in out.iterdir():
                        f.unlink()
                    out.rmdir()
                else:
                    t0 = time.perf_counter()
                    rep = publish_tensors([proxy_url], iter(tensors.items()), version, sender=sender, bucket_mb=args.bucket_mb)
                    dt = time.perf_counter() - t0
                    if r == 0:  # the first publish also makes the process group
                        first = {"first_publish_s": round(dt, 3), "connect_s": rep.timings_s.get("connect")}
                        continue
                    times.append(dt)
                    extra.append({"transfer_s": rep.timings_s.get("transfer", 0.0)})
            med = statistics.median(times)
            row = {"transfer": mode, "gb": round(gb, 3), "publish_median_s": round(med, 3), "s_per_gb": round(med / gb, 3),
                   "repeats": len(times)}
            for k in extra[0]:
                row[k + "_median"] = round(statistics.median(e[k] for e in extra), 3)
            if mode == "distributed":
                row.update(first)
                row["backend"] = "gloo"
                row["bucket_mb"] = args.bucket_mb
            results.append(row)
            print(f"{mode:<12} {gb:6.3f} GB  publish median {med:7.3f}s  = {med / gb:6.3f} s/GB  "
                  + "  ".join(f"{k} {v}" for k, v in row.items() if k.endswith("_median") or k.startswith("first")), flush=True)
    finally:
        sender.close()
        proc.terminate()
        try:
            proc.wait(20)
        except Exception:  # noqa: BLE001
            proc.kill()
        stop()
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return {"bench": "publish-transfer", "cpu_count": os.cpu_count(), "model_gb": round(gb, 3), "results": results,
            "note": "one reference engine (CPU, float32) behind one proxy on loopback; gloo"}
