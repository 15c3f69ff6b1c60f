"""``splice demo``: the whole loop on one machine.

Starts the reference engine (script mode, so agents see well-formed tool calls from a tiny
random model) and the proxy as separate processes, runs groups of openai-agents sessions with
a function tool, posts rewards, and runs the GRPO trainer (``splice train``) as a third
process that publishes new weights while generations are in flight. Prints a summary, writes
a plot, and exits non-zero when an invariant of the recorded data fails.

The tiny model is random, so the reward is a seeded stand-in for a task score; the point is
the plumbing: versions, proximal values, aborts, splicing and the trainer, on real parts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from engines.reference.launch import free_port, wait_healthy

from .invariants import check_sample, check_session


def _call(a: int, b: int, note: str) -> str:
    # Compact JSON, as models often write it: a re-render would re-serialize it with spaces.
    return (
        f"<think>\nI should add {a} and {b}. {note}\n</think>\n\n<tool_call>\n"
        f'{{"name":"add","arguments":{{"a":{a},"b":{b}}}}}\n</tool_call><|im_end|>'
    )


SCRIPT = [
    _call(1, 2, "Start with the first pair and keep the running total in mind."),
    _call(3, 4, "Then the second pair, then report."),
    "<think>\nBoth sums are known now.\n</think>\n\nThe sums are 3 and 7.<|im_end|>",
]


def _wait(url: str, proc: subprocess.Popen, timeout_s: float = 180.0) -> None:
    try:
        wait_healthy(url, timeout_s, alive=lambda: proc.poll() is None)
    except (RuntimeError, TimeoutError) as exc:
        raise SystemExit(f"a demo process did not start: {exc}")


async def _run_session(base: str, session_id: str, group_id: str, group_size: int, rng: random.Random) -> tuple[int, float]:
    from agents import Agent, OpenAIResponsesModel, Runner, function_tool
    from openai import AsyncOpenAI

    headers = {"X-Session-Id": session_id, "X-Group-Id": group_id, "X-Group-Size": str(group_size)}
    client = AsyncOpenAI(base_url=base + "/v1", api_key="demo", default_headers=headers, max_retries=5, timeout=300)

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    agent = Agent(name="adder", instructions="Add the numbers with the add tool.", tools=[add],
                  model=OpenAIResponsesModel(model="splice-model", openai_client=client))
    try:
        result = await Runner.run(agent, "What are 1+2 and 3+4?", max_turns=8)
        answer = str(result.final_output)
    except Exception as exc:  # e.g. MaxTurnsExceeded: the episode fails, it still gets a reward
        answer = f"failed: {type(exc).__name__}"
    reward = rng.random() + (0.5 if "7" in answer else 0.0)
    async with httpx.AsyncClient(timeout=60) as h:
        r = await h.post(f"{base}/v1/sessions/{session_id}/reward", json={"reward": reward})
        r.raise_for_status()
    await client.close()
    return 1, reward


async def _agents(base: str, group_size: int, concurrency: int, seed: int, trainer: subprocess.Popen, min_groups: int, max_groups: int) -> list[str]:
    """Launch groups of sessions until the trainer is done (so weight updates land mid-generation)."""
    from agents import set_tracing_disabled

    set_tracing_disabled(True)
    rng = random.Random(seed)
    ids: list[str] = []
    running: set[asyncio.Task] = set()
    g = 0
    while g < max_groups and (g < min_groups or trainer.poll() is None):
        while len(running) * group_size >= concurrency:
            _, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
        group = [f"demo-g{g}-s{k}" for k in range(group_size)]
        ids += group
        running.add(asyncio.ensure_future(asyncio.gather(
            *(_run_session(base, sid, f"demo-g{g}", group_size, random.Random(rng.random())) for sid in group)
        )))
        g += 1
    if running:
        await asyncio.gather(*running)
    return ids


def _metric(text: str, name: str, label: str | None = None) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        m = re.match(rf"{re.escape(name)}(?:_total)?(\{{[^}}]*\}})?\s+([-+0-9.eE]+|NaN|\+Inf)$", line)
        if m and (label is None or (m.group(1) and label in m.group(1))):
            total += float(m.group(2))
    return total


def _plot(stats: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in ("loss", "reward_mean", "behav_imp_weight_mean", "behav_imp_weight_max", "clip_frac", "entropy", "staleness_mean")
            if any(k in s for s in stats)]
    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.2 * len(keys)), sharex=True, squeeze=False)
    steps = [s["step"] for s in stats]
    for ax, k in zip(axes[:, 0], keys):
        ax.plot(steps, [s.get(k, float("nan")) for s in stats], marker="o")
        ax.set_ylabel(k.replace("_", " "))
        ax.grid(alpha=0.3)
    from matplotlib.ticker import MaxNLocator

    axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[-1, 0].set_xlabel("training step")
    fig.suptitle("splice demo: per-step trainer metrics")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="splice demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=4, help="groups to run at least")
    p.add_argument("--max-groups", type=int, default=40, help="groups to run at most while the trainer trains")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--token-delay-ms", type=int, default=15, help="script pace, so updates land mid-generation")
    p.add_argument("--out", default=None, help="run directory (default: runs/demo-<time>)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    from engines.reference.model_init import ensure_model

    t_start = time.monotonic()
    run = Path(args.out or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}").absolute()
    run.mkdir(parents=True, exist_ok=True)
    model_dir = str(ensure_model())
    script = run / "script.json"
    script.write_text(json.dumps(SCRIPT))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs: list[subprocess.Popen] = []
    print(f"splice demo: run dir {run}")
    try:
        proxy = subprocess.Popen(
            [sys.executable, "-m", "proxy.cli", "serve", "--port", str(port), "--store", str(run / "splice.sqlite"),
             "--reference-model", model_dir, "--reference-script", str(script),
             "--reference-script-delay-ms", str(args.token_delay_ms), "--max-context", "4096"],
            env=env, start_new_session=True, stdout=open(run / "proxy.log", "w"), stderr=subprocess.STDOUT,
        )
        procs.append(proxy)
        _wait(base, proxy)
        print(f"  proxy + reference engine up at {base} ({time.monotonic() - t_start:.0f}s)")
        trainer = subprocess.Popen(
            [sys.executable, "-m", "proxy.cli", "train", "--proxy", base, "--model", model_dir, "--steps", str(args.steps),
             "--out", str(run / "train"), "--batch-samples", str(args.group_size), "--min-samples", str(args.group_size),
             "--lr", "1e-4", "--pull-wait-s", "5", "--pull-timeout-s", "240", "--no-progress"],
            env=env, start_new_session=True, stdout=open(run / "trainer.log", "w"), stderr=subprocess.STDOUT,
        )
        procs.append(trainer)
        session_ids = asyncio.run(
            _agents(base, args.group_size, args.concurrency, args.seed, trainer, args.groups, args.max_groups)
        )
        print(f"  {len(session_ids)} agent sessions finished ({time.monotonic() - t_start:.0f}s)")
        try:
            trainer.wait(timeout=300)
        except subprocess.TimeoutExpired:
            trainer.kill()
            raise SystemExit("the trainer did not finish in time; see trainer.log")
        if trainer.returncode != 0:
            print((run / "trainer.log").read_text()[-3000:])
            raise SystemExit(f"the trainer failed with code {trainer.returncode}; see {run / 'trainer.log'}")
        return _report(base, run, session_ids, t_start)
    finally:
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


def _report(base: str, run: Path, session_ids: list[str], t_start: float) -> int:
    sessions = [httpx.get(f"{base}/v1/sessions/{sid}", timeout=60).json() for sid in session_ids]
    metrics = httpx.get(f"{base}/metrics", timeout=30).text
    stats = [json.loads(line) for line in (run / "train" / "stats.jsonl").read_text().splitlines() if line.strip()]
    # What is left in the pool, pulled and checked (then acked) like a trainer would.
    left = httpx.post(f"{base}/v1/trajectories/pull", json={"max_samples": 1000, "wait_s": 0}, timeout=120).json()
    problems: list[str] = []
    turns_by_session = {s["session_id"]: s["turns"] for s in sessions}
    for s in sessions:
        problems += check_session(s)
    for sample in left["samples"]:
        problems += check_sample(sample, turns_by_session.get(sample["session_id"], []))
    if left.get("lease_id"):
        httpx.post(f"{base}/v1/trajectories/ack", json={"lease_id": left["lease_id"]}, timeout=30)

    turns = [t for s in sessions for t in s["turns"]]
    versions = sorted({v for t in turns for v in t["versions"]})
    multi_version_turns = sum(len(set(t["versions"])) > 1 for t in turns)
    forks: dict[str, int] = {}
    for s in sessions:
        for k, v in s["forks"].items():
            forks[k] = forks.get(k, 0) + v
    spliced = sum(t["spliced"] for t in turns)
    later = sum(t["index"] > 0 for t in turns)
    recomputed = sum(1 for t in turns for v, pv in zip(t["versions"], t["proximal_versions"]) if pv == v + 1)
    rows = [
        ("sessions", len(sessions)),
        ("turns", len(turns)),
        ("spliced share of later turns", f"{spliced}/{later}"),
        ("forks by reason", json.dumps(forks) if forks else "none"),
        ("prompt tokens / output tokens", f"{int(_metric(metrics, 'splice_prompt_tokens'))} / {int(_metric(metrics, 'splice_output_tokens'))}"),
        ("drift avoided (turns)", int(_metric(metrics, "splice_drift_avoided"))),
        ("aborts / resumes", f"{int(_metric(metrics, 'splice_aborts'))} / {int(_metric(metrics, 'splice_resumes'))}"),
        ("turns spanning several versions", multi_version_turns),
        ("policy versions seen", versions),
        ("proximal values recomputed (tokens)", recomputed),
        ("trainer steps", len(stats)),
    ]
    for s in stats:
        rows.append(
            (f"step {s['step']}", f"reward {s.get('reward_mean', float('nan')):+.3f}  loss {s.get('loss', float('nan')):+.4f}  "
             f"w mean {s.get('behav_imp_weight_mean', float('nan')):.3f} max {s.get('behav_imp_weight_max', float('nan')):.3f}")
        )
    width = max(len(r[0]) for r in rows)
    print("\n" + "=" * (width + 40))
    for k, v in rows:
        print(f"{k.ljust(width)}  {v}")
    print("=" * (width + 40))
    plot = run / "demo_metrics.png"
    if stats:
        _plot(stats, plot)
        print(f"plot: {plot}")
    if len(stats) < 2 or max(versions or [0]) < 2:
        problems.append(f"expected at least two weight updates during the run, saw versions {versions}")
    print(f"finished in {time.monotonic() - t_start:.0f}s")
    if problems:
        print(f"\nINVARIANT FAILURES ({len(problems)}):")
        for msg in problems[:50]:
            print("  - " + msg)
        return 1
    print("all invariants hold (SPEC sections 2-5)")
    return 0
