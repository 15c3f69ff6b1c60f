"""``splice demo``: GRPO on a task graded from the sampled text, through the proxy, on one machine.

Phases: (1) ``splice init-model`` writes a tiny Qwen3-architecture model (real Qwen3 tokenizer)
and warm-starts it for a few seconds on the task's *format*; (2) ``splice engine`` serves it
(the CPU reference engine, sampling for real); (3) ``splice serve`` runs the proxy in front of
it; (4) ``splice train`` (the GRPO trainer, decoupled PPO loss) pulls token-exact samples and
publishes new weights every step, while openai-agents sessions keep playing the two-turn task
(``task.py``), so updates land mid-generation; (5) every recorded session and leftover sample
is checked against docs/design.md sections 2-5 (``invariants.py``), and the run folder gets
``summary.json`` and ``demo_metrics.png``. Exit status 1 when an invariant fails.

With ``--engine-url URL --model ID`` phases 1-2 are skipped and the same task, proxy and trainer
run against a real SGLang or vLLM server (see docs/demo.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from engines.reference.launch import free_port, wait_healthy

from . import task
from .driver import Driver
from .invariants import agreement_problems, check_sample, check_session
from .progress import Progress, bar
from .report import build_summary, table

SERVED_NAME = "splice-model"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="splice demo", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=10, help="training steps (one published version each)")
    p.add_argument("--groups-per-step", type=int, default=8, help="GRPO groups per training batch")
    p.add_argument("--group-size", type=int, default=4, help="sessions per group (same prompt)")
    p.add_argument("--lead", type=int, default=1, help="training steps' worth of sessions launched ahead of the trainer")
    p.add_argument("--concurrency", type=int, default=16, help="sessions in flight at most")
    p.add_argument("--lr", type=float, default=1e-3, help="trainer learning rate (use ~1e-6 for a real model)")
    p.add_argument("--minibatches", type=int, default=2, help="PPO optimizer steps per training step")
    p.add_argument("--lr-warmup-steps", type=int, default=2,
                   help="optimizer steps of linear lr warm-up (AdamW's first full-size sign steps are noise on 32 sessions)")
    p.add_argument("--max-output-tokens", type=int, default=16, help="per turn (raise it for a real, thinking model)")
    p.add_argument("--token-delay-ms", type=float, default=25.0, help="reference engine pace per token, so updates land mid-generation")
    p.add_argument("--warm-start-steps", type=int, default=30, help="format warm start of the tiny model (Adam steps)")
    p.add_argument("--seed", type=int, default=0, help="seeds the model, the warm start, the prompts, sampling and the trainer")
    p.add_argument("--out", default=None, help="run directory (default: runs/demo-<time>)")
    p.add_argument("--engine-url", default=None, help="a running SGLang/vLLM server instead of the CPU reference engine")
    p.add_argument("--engine", choices=["sglang", "vllm"], default="sglang", help="the --engine-url server's API")
    p.add_argument("--model", default=None, help="with --engine-url: the served model (local dir or hub id); the trainer starts from it")
    return p


def _resolve_model(model: str) -> str:
    """A local directory for the trainer: ``model`` itself, else a hub snapshot of it."""
    if Path(model).is_dir():
        return str(Path(model).absolute())
    from huggingface_hub import snapshot_download

    return snapshot_download(model)


def _spawn(cmd: list[str], log: Path, env: dict[str, str], procs: list[subprocess.Popen], **kw: Any) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=kw.pop("stdout", None) or open(log, "w"),
                            stderr=subprocess.STDOUT, **kw)
    procs.append(proc)
    return proc


def _wait(url: str, proc: subprocess.Popen, what: str, log: Path, timeout_s: float = 180.0) -> None:
    try:
        wait_healthy(url, timeout_s, alive=lambda: proc.poll() is None)
    except (RuntimeError, TimeoutError) as exc:
        tail = log.read_text(errors="replace")[-2000:] if log.is_file() else ""
        raise SystemExit(f"the {what} did not start: {exc}\n{tail}")


def _init_model(run: Path, args: argparse.Namespace, env: dict[str, str], prog: Progress, procs: list) -> Path:
    """``splice init-model`` with the format warm start, relaying its progress."""
    model_dir = run / "model"
    data = task.write_warm_start(run / "warm_start.jsonl", 2000, args.seed)
    cmd = [sys.executable, "-m", "proxy.cli", "init-model", str(model_dir), "--seed", str(args.seed), "--head-dim", "64",
           "--warm-start", str(data), "--warm-start-steps", str(args.warm_start_steps), "--threads", "1"]
    log = run / "init_model.log"
    with open(log, "w") as logf:
        proc = _spawn(cmd, log, env, procs, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        last = ""
        for line in proc.stdout:
            logf.write(line)
            if line.startswith("warm start step"):
                last = line.strip()
                k, n = (int(v) for v in line.split()[3].split("/"))
                prog.live(f"model    warm start [{bar(k, n)}] {last[len('warm start '):]}")
        proc.wait()
    if proc.returncode != 0:
        raise SystemExit(f"init-model failed ({proc.returncode}); see {log}")
    prog.phase("model", f"tiny Qwen3 (hidden 64, 2 layers, head_dim 64) warm-started on the task format: {last or 'done'}")
    return model_dir


def _agree(r: dict[str, Any]) -> str:
    err = r.get("token_mult_prob_error")
    return "-" if err is None else f"{err:.5f}"


class StatsTail:
    """Follows the trainer's stats.jsonl; prints a line per finished step."""

    def __init__(self, path: Path, steps: int, prog: Progress):
        self.path, self.steps, self.prog = path, steps, prog
        self.records: list[dict[str, Any]] = []
        self._pos = 0
        self._last_t = prog.elapsed()

    def poll(self) -> int:
        if self.path.is_file():
            with self.path.open() as f:
                f.seek(self._pos)
                chunk = f.read()
            lines = chunk.split("\n")
            complete, rest = lines[:-1], lines[-1]
            self._pos += len(chunk) - len(rest)
            for line in complete:
                if line.strip():
                    self._step(json.loads(line))
        return len(self.records)

    def _step(self, r: dict[str, Any]) -> None:
        self.records.append(r)
        now = self.prog.elapsed()
        self.prog.line(
            f"step {r['step']:>2}/{self.steps} [{bar(r['step'], self.steps, 12)}] v{r['version']}"
            f" | reward {r.get('reward_mean', 0):.3f}±{r.get('reward_std', 0):.3f} over {r.get('n_sessions', 0)} sessions"
            f" | w {r.get('behav_imp_weight_mean', 1):.3f} max {r.get('behav_imp_weight_max', 1):.2f}"
            f" | stale {r.get('staleness_mean', 0):.2f} | ent {r.get('entropy_mean', 0):.2f}"
            f" | agree {_agree(r)}"
            f" | train {r.get('train_time_s', 0):.1f}s publish {r.get('publish_time_s', 0):.1f}s | step took {now - self._last_t:.1f}s"
        )
        self._last_t = now


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.engine_url and not args.model:
        raise SystemExit("--engine-url needs --model (the model the server serves; the trainer starts from the same weights)")
    t_start = time.monotonic()
    prog = Progress(t0=t_start)
    run = Path(args.out or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}").absolute()
    run.mkdir(parents=True, exist_ok=True)
    # the run's own admin token, for its proxy, trainer and grader (SPLICE_ADMIN_TOKEN is read by
    # splice serve and splice train alike): the user's token file is left alone
    admin_token = os.environ.get("SPLICE_ADMIN_TOKEN") or secrets.token_urlsafe(24)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "SPLICE_ADMIN_TOKEN": admin_token}
    admin_headers = {"Authorization": f"Bearer {admin_token}"}
    if not args.engine_url:
        env.setdefault("HF_HUB_OFFLINE", "1")
    batch = args.groups_per_step * args.group_size
    prog.line(f"splice demo: task {task.NAME} (reward computed from the sampled text, chance {task.chance_reward():.2f}), "
              f"seed {args.seed}, {args.steps} steps x {batch} sessions; run dir {run}")
    procs: list[subprocess.Popen] = []
    try:
        # 1-2: model and engine
        if args.engine_url:
            engine_url = args.engine_url.rstrip("/")
            model_dir, model_name = _resolve_model(args.model), args.model
            prog.phase("model", f"{args.model} (trainer copy: {model_dir})")
            prog.phase("engine", f"{args.engine} server at {engine_url} (external)")
        else:
            model_dir, model_name = str(_init_model(run, args, env, prog, procs)), SERVED_NAME
            port = free_port()
            engine_url = f"http://127.0.0.1:{port}"
            log = run / "engine.log"
            engine = _spawn([sys.executable, "-m", "proxy.cli", "engine", "--model", model_dir, "--port", str(port),
                             "--token-delay-ms", str(args.token_delay_ms), "--seed", str(args.seed),
                             "--served-model-name", SERVED_NAME, "--threads", "1"], log, env, procs)
            prog.live("engine   starting the CPU reference engine ...")
            _wait(engine_url, engine, "reference engine", log)
            prog.phase("engine", f"reference engine (SGLang API, sampling at T=1, {args.token_delay_ms:g} ms/token) up at {engine_url}")

        # 3: proxy
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "proxy.cli", "serve", "--engine", args.engine, "--engine-url", engine_url,
               "--tokenizer", model_dir, "--model-name", model_name, "--store", str(run / "splice.sqlite"), "--port", str(port)]
        if not args.engine_url:
            cmd += ["--renderer", "qwen3"]
        log = run / "proxy.log"
        proxy = _spawn(cmd, log, env, procs)
        prog.live("proxy    starting ...")
        _wait(base, proxy, "proxy", log)
        prog.phase("proxy", f"splice serve up at {base} (store {run / 'splice.sqlite'})")
        for warning in engine_warnings(log):
            prog.line(f"WARNING  {warning}")

        # 4: trainer + agents
        trainer = _spawn(
            [sys.executable, "-m", "proxy.cli", "train", "--proxy", base, "--model", model_dir, "--steps", str(args.steps),
             "--out", str(run / "train"), "--batch-samples", str(batch), "--min-samples", str(batch), "--lr", str(args.lr),
             "--ppo-n-minibatches", str(args.minibatches), "--lr-warmup-steps", str(args.lr_warmup_steps), "--seed", str(args.seed), "--pull-wait-s", "5",
             "--pull-timeout-s", "240", "--keep-last", "2", "--no-progress", "--log-sessions"],
            run / "trainer.log", env, procs,
        )
        prog.phase("trainer", f"splice train: GRPO, decoupled PPO (segment-wise w), lr {args.lr:g}, "
                              f"{args.minibatches} minibatches/step; publishes v+1 through the proxy after every step")
        tail = StatsTail(run / "train" / "stats.jsonl", args.steps, prog)
        driver = Driver(base=base, model_name=model_name, group_size=args.group_size, groups_per_step=args.groups_per_step,
                        steps=args.steps, lead=args.lead, concurrency=args.concurrency,
                        max_output_tokens=args.max_output_tokens, seed=args.seed, steps_done=lambda: 0, trainer=trainer,
                        admin_headers=admin_headers)

        def steps_done() -> int:
            n = tail.poll()
            done = len(driver.results)
            prog.live(f"sessions {done} done, {driver.running} running, {driver.launched} launched"
                      f" | trainer on step {min(n + 1, args.steps)}/{args.steps}")
            return n

        driver.steps_done = steps_done
        results = asyncio.run(driver.run())
        tail.poll()
        prog.phase("sessions", f"{len(results)} sessions finished ({sum(r.error is not None for r in results)} with a failed turn)")
        try:
            trainer.wait(timeout=60)
        except subprocess.TimeoutExpired:
            raise SystemExit("the trainer did not finish in time; see trainer.log")
        if trainer.returncode != 0:
            print((run / "trainer.log").read_text()[-3000:])
            raise SystemExit(f"the trainer failed with code {trainer.returncode}; see {run / 'trainer.log'}")
        return _report(base, run, args, results, tail.records, prog, model_name, admin_headers)
    finally:
        prog.done()
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def engine_warnings(log: Path) -> list[str]:
    """The WARNING lines ``splice serve`` logged so far (engine facts at start-up: missing dev
    mode, a tied head without the vLLM extension, ...), for the console the user watches."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return []
    return [line.split("WARNING", 1)[1].strip(" :-") for line in text.splitlines() if "WARNING" in line][:20]


def _report(base: str, run: Path, args: argparse.Namespace, results: list, stats: list[dict[str, Any]], prog: Progress,
            model_name: str, admin_headers: dict[str, str]) -> int:
    prog.live("report   reading the recorded sessions ...")
    with httpx.Client(base_url=base, timeout=120, headers=admin_headers) as h:
        sessions = [h.get(f"/v1/sessions/{r.session_id}").json() for r in results]
        metrics = h.get("/metrics").text
        # What is left in the pool, pulled and checked (then acked) like a trainer would.
        left = h.post("/v1/trajectories/pull", json={"max_samples": 10000, "wait_s": 0}).json()
        turns_by_session = {s["session_id"]: s["turns"] for s in sessions}
        problems: list[str] = []
        for s in sessions:
            problems += check_session(s)
        for sample in left["samples"]:
            problems += check_sample(sample, turns_by_session.get(sample["session_id"], []))
        if left.get("lease_id"):
            h.post("/v1/trajectories/ack", json={"lease_id": left["lease_id"]})
    versions = sorted({v for s in sessions for t in s["turns"] for v in t["versions"]})
    if len(stats) < args.steps:
        problems.append(f"the trainer finished {len(stats)} of {args.steps} steps")
    if max(versions or [0]) < 2:
        problems.append(f"expected at least two weight updates during the run, saw versions {versions}")
    problems += agreement_problems(stats)
    summary = build_summary(
        task={"name": task.NAME, "description": task.DESCRIPTION, "chance_reward": task.chance_reward(),
              "reward": "computed by the demo from each turn's sampled message text (proxy/demo/task.py), posted to the proxy"},
        stats=stats,
        sessions=sessions,
        rewards={r.session_id: r.reward for r in results},
        metrics_text=metrics,
        problems=problems,
        checked={"sessions_checked": len(sessions), "leftover_samples_checked": len(left["samples"])},
        extra={"seed": args.seed,
               "failed_sessions": {"n": sum(r.error is not None for r in results),
                                   "errors": sorted({r.error.split(":")[0] for r in results if r.error})}, "model": model_name, "engine": args.engine_url or "reference (CPU)",
               "config": {k: v for k, v in vars(args).items() if k not in ("out",)},
               "wall_time_s": round(prog.elapsed(), 1)},
    )
    (run / "summary.json").write_text(json.dumps(summary, indent=1))
    (run / "sessions_answers.jsonl").write_text("".join(json.dumps(r.__dict__) + "\n" for r in results))
    from .plot import plot_summary

    plot = plot_summary(summary, run / "demo_metrics.png")
    prog.done()
    print("\n" + table(summary))
    print(f"summary: {run / 'summary.json'}\nplot:    {plot}")
    print(f"finished in {prog.elapsed():.0f}s")
    if problems:
        print(f"\nINVARIANT FAILURES ({len(problems)}):")
        for msg in problems[:50]:
            print("  - " + msg)
        return 1
    print("all invariants hold (docs/design.md sections 2-5)")
    return 0
