"""``splice bench train``: the trainer at world size 1 and 2 on this machine (CPU, gloo);
``--gpu``: on one CUDA device beside a hand-written baseline (``trainer_bridge.bench_gpu``).

Builds a randomly initialised Qwen3-architecture model (``--hidden``/``--layers``/``--vocab``),
then for each world size runs ``trainer_bridge.bench`` (one process, or ``torchrun`` with N
ranks) on one batch of log-uniform sample lengths and prints, per rank: bytes of parameters,
gradients and AdamW state held locally (FSDP2 shards), peak RSS; and per run: tokens/s of the
last step, the padding share (packed, and what one padded row per sample would have cost), and
the busiest rank's planned cost over the mean.

The trainer runs in child processes (it needs torch; the proxy package never imports it).
The machine's cores are split between the ranks (``OMP_NUM_THREADS``), so tokens/s compares
the same hardware.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

def add_parser(sub) -> None:
    p = sub.add_parser("train", help="FSDP2 trainer: per-rank state bytes, peak RSS, tokens/s, padding, imbalance")
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2], help="world sizes to run")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--samples", type=int, default=None, help="samples in the batch (default 12; --gpu: 16 of 2k-16k tokens)")
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=8000)
    p.add_argument("--steps", type=int, default=2, help="training steps per run (tokens/s from the last)")
    p.add_argument("--micro-batch-tokens", type=int, default=8192)
    p.add_argument("--model", help="an existing HF model directory instead of a random one")
    p.add_argument("--out")
    p.add_argument("--gpu", action="store_true",
                   help="one CUDA device: Qwen3-shaped random models at the real vocabulary, the trainer beside a "
                        "hand-written transformers baseline, MFU, peak memory split, publish s/GB, attention kernels")
    p.add_argument("--gpu-models", default="0.6b,4b", help="--gpu: model shapes (0.6b, 1.7b, 4b)")
    p.add_argument("--gpu-args", default="", help="--gpu: extra arguments for python -m trainer_bridge.bench_gpu, "
                                                  "e.g. '--attn splice_flex --ac-every 2'")


def _env(threads: int) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "OMP_NUM_THREADS": str(threads), "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
            "MASTER_ADDR": "127.0.0.1"}


def _run_world(world: int, model: str, out: Path, args) -> dict:
    worker = ["-m", "trainer_bridge.bench", "--model", model, "--out", str(out), "--samples", str(args.samples),
              "--min-len", str(args.min_len), "--max-len", str(args.max_len), "--steps", str(args.steps),
              "--micro-batch-tokens", str(args.micro_batch_tokens)]
    cores = os.cpu_count() or 1
    if world == 1:
        cmd = [sys.executable, *worker]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), *worker]
    proc = subprocess.run(cmd, env=_env(max(1, cores // world)), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"world size {world} failed:\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def _mb(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def run_gpu(args) -> dict:
    """``--gpu``: ``trainer_bridge.bench_gpu`` in a child process, then its table."""
    import shlex

    with tempfile.TemporaryDirectory(prefix="splice-bench-gpu-") as tmp:
        out = Path(tmp) / "gpu.json"
        cmd = [sys.executable, "-m", "trainer_bridge.bench_gpu", "--out", str(out), "--models", args.gpu_models,
               "--samples", str(args.samples or 16), "--micro-batch-tokens", str(args.micro_batch_tokens),
               *shlex.split(args.gpu_args)]
        proc = subprocess.run(cmd, env=_env(os.cpu_count() or 1), capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            raise SystemExit(f"bench_gpu failed:\n{proc.stderr[-4000:]}")
        result = json.loads(out.read_text())
    print_gpu_table(result)
    return result


def print_gpu_table(result: dict) -> None:
    peak = result.get("peak_flops")
    print(f"device: {result['device']} (torch {result['torch']}), dense bf16 peak "
          f"{peak / 1e12:,.0f} TFLOP/s" if peak else f"device: {result['device']}")
    att = result.get("attention_ms") or {}
    if att:
        kernels = [k for k in att if not k.endswith(("_error", "_layout_build"))]
        print("attention, one packed row, forward + backward (ms): "
              + ", ".join(f"{k} {att[k]:.2f}" for k in kernels))
    print(f"{'model':>6} {'run':>9} {'tokens/s':>9} {'MFU 6N':>7} {'+attn':>6} {'fwd/bwd GiB':>11} {'optim GiB':>9}"
          f" {'publish s':>9} {'s/GB':>5}")
    for run in result["runs"]:
        for name in ("trainer", "baseline"):
            r = run.get(name)
            if r is None:
                continue
            if "tokens_per_s" not in r:
                print(f"{run['model']:>6} {name:>9} failed: {r.get('error')}")
                continue
            pub = f"{r['publish_s']:>9.2f} {r['publish_s'] / r['publish_gb']:>5.2f}" if "publish_s" in r else ""
            print(f"{run['model']:>6} {name:>9} {r['tokens_per_s']:>9,.0f} {r.get('mfu_6n', 0):>7.1%}"
                  f" {r.get('mfu_6n_attn', 0):>6.1%} {r['peak_fwd_bwd_gib']:>11.1f} {r['peak_optim_gib']:>9.1f} {pub}")


def run(args) -> dict:
    if getattr(args, "gpu", False):
        return run_gpu(args)
    args.samples = args.samples or 12
    with tempfile.TemporaryDirectory(prefix="splice-bench-train-") as tmp:
        model, n_params = args.model, None
        if model is None:
            model = str(Path(tmp) / "model")
            made = subprocess.run([sys.executable, "-m", "trainer_bridge.bench", "--make-model", model, "--hidden",
                                   str(args.hidden), "--layers", str(args.layers), "--vocab", str(args.vocab)],
                                  env=_env(1), capture_output=True, text=True, check=True)
            n_params = int(made.stdout.strip().splitlines()[-1])
        results = [_run_world(w, model, Path(tmp) / f"w{w}.json", args) for w in args.worlds]
    n_params = n_params or results[0]["ranks"][0]["n_params"]
    base = None
    print(f"model: {n_params / 1e6:.1f}M parameters (float32 masters); batch: {args.samples} samples, "
          f"log-uniform {args.min_len}-{args.max_len} tokens, {results[0]['tokens_per_step']} tokens/step; "
          f"micro-batch {args.micro_batch_tokens} tokens; {os.cpu_count()} CPU cores split over the ranks")
    print(f"{'world':>5} {'rank':>4} {'params MB':>10} {'grads MB':>9} {'AdamW MB':>9} {'state MB':>9} {'vs w1':>6}"
          f" {'peak RSS MB':>11} {'tokens/s':>9} {'padding':>8} {'(unpacked)':>10} {'busiest/mean':>12}")
    for res in results:
        last = res["steps"][-1]
        tps = res["tokens_per_step"] / last["time_s"]
        for r in res["ranks"]:
            state = r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"]
            r["state_bytes"] = state
            if base is None:
                base = state
            print(f"{res['world_size']:>5} {r['rank']:>4} {_mb(r['param_bytes']):>10} {_mb(r['grad_bytes']):>9}"
                  f" {_mb(r['optim_bytes']):>9} {_mb(state):>9} {state / base:>6.2f} {r['peak_rss_mb']:>11,.0f}"
                  f" {tps:>9,.0f} {last['padding_frac']:>8.2%} {last['padding_frac_unpacked']:>10.1%}"
                  f" {last['imbalance']:>12.3f}")
        res["tokens_per_s"] = tps
    return {"n_params": n_params, "args": {k: v for k, v in vars(args).items() if k != "func"}, "results": results}
