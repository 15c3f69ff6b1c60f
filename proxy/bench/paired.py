"""``splice bench paired``: two Splice trees side by side, in short alternating blocks.

On a shared 2-core machine one run's proxy CPU per turn moves by 10-20% with the machine's
moment, more than most single changes to the hot path. Here both trees serve at once, in front
of one engine stand-in, and take turns in blocks of a few sessions in ABBA order, so both see
the same moments; each block's proxy CPU is read from the kernel's per-thread run time
(``/proc/PID/task/*/schedstat``, nanoseconds) around it. Each round gives a ratio of the two
(``tree / base``); their median is the comparison.

Each round also times the stand-in's own ``/v1/chat/completions`` (a block of the same turns,
no proxy), so it gives each tree's added latency at the median, ``p50(tree) - p50(stand-in)``,
taken at the same moments as the tree's: the issue's "added p50", paired like the CPU.

A tree is a directory holding Splice's packages, e.g. ``git worktree add /tmp/base <commit>``.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

from . import loadgen
from .overhead import quantile
from .stack import reply_ids, start_splice, start_standin, stop_all, wait_http
from .tables import format_table
from .workload import SYSTEM, TOOL, USER

TURNS = 12  # per session, as in ``splice bench overhead``'s C=1 row


def add_parser(sub) -> None:
    p = sub.add_parser("paired", help="proxy CPU per turn of two trees, side by side in alternating blocks")
    p.add_argument("--base", required=True, help="the tree to compare against (a directory with Splice's packages)")
    p.add_argument("--tree", default=str(Path(__file__).resolve().parents[2]), help="the tree measured (default: this one)")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--turns-per-block", type=int, default=240, help="turns each tree runs per round, in two blocks")
    p.add_argument("-c", "--concurrency", type=int, default=1)
    p.add_argument("--base-args", default="", help="extra `splice serve` flags for the base, e.g. '--drift-check off'")
    p.add_argument("--tree-args", default="", help="extra `splice serve` flags for the tree")
    p.add_argument("--out")


def p50(lat: list[float]) -> float:
    """The median of ``lat`` (seconds) in ms, read as ``splice bench overhead`` reads it."""
    return quantile(sorted(lat), 0.5) * 1e3


def cpu_seconds(pid: int) -> float:
    """Run time so far of every live thread of ``pid``, from the scheduler's nanosecond counters
    (a thread that ends is no longer listed; Splice's threads live as long as the server)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # a thread that ended meanwhile
    return total / 1e9


def run(args) -> dict:
    result = measure(args)
    s = result["summary"]
    print(f"\nProxy CPU ms per turn, C={args.concurrency}, {args.rounds} rounds of {args.turns_per_block} turns per tree "
          "in ABBA blocks (median over rounds):")  # fmt: skip
    print(format_table(["", "base", "tree", "tree / base (median)", "mean", "min", "max"],
                       [["CPU ms/turn", f"{s['base_ms']:.3f}", f"{s['tree_ms']:.3f}", f"{s['ratio_median']:.3f}",
                         f"{s['ratio_mean']:.3f}", f"{s['ratio_min']:.3f}", f"{s['ratio_max']:.3f}"],
                        ["added p50 ms", f"{s['base_added_p50_ms']:.3f}", f"{s['tree_added_p50_ms']:.3f}",
                         f"{s['added_ratio_median']:.3f}", f"{s['added_ratio_mean']:.3f}", f"{s['added_ratio_min']:.3f}",
                         f"{s['added_ratio_max']:.3f}"]]))  # fmt: skip
    print(f"added p50 = p50 of the tree's turns minus p50 of the stand-in's own /v1/chat/completions in the same round "
          f"(stand-in p50, median over rounds: {s['standin_p50_ms']:.3f} ms)")
    return result


def measure(args) -> dict:
    from tokenization import load_tokenizer, qwen3_tokenizer_dir

    if not os.path.isdir(os.path.join(args.base, "proxy")):
        raise SystemExit(f"--base {args.base}: not a Splice tree (no proxy/ in it)")
    tok_dir = str(qwen3_tokenizer_dir())
    tok = load_tokenizer(tok_dir)
    procs: list[subprocess.Popen] = []
    tmp = tempfile.mkdtemp(prefix="splice_bench_paired_")
    sides = {"base": (args.base, args.base_args.split()), "tree": (args.tree, args.tree_args.split())}
    try:
        engine_url = start_standin(tmp, tok, reply_ids(tok), procs)
        ports = {}
        for name, (tree, extra) in sides.items():
            os.makedirs(os.path.join(tmp, name))
            ports[name] = start_splice(os.path.join(tmp, name), engine_url, tok_dir, procs, extra, tree=tree)
        servers = dict(zip(sides, procs[-2:]))
        for name, proc in servers.items():
            if why := wait_http(f"http://127.0.0.1:{ports[name]}/v1/models", proc):
                raise SystemExit(f"{name} ({sides[name][0]}): splice serve {why}")
        ports["standin"] = int(engine_url.rsplit(":", 1)[1])
        base = {"host": "127.0.0.1", "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}],
                "tools": [{"type": "function", "function": TOOL}], "mode": "chat", "model": "m", "session_header": True}
        blocks = 0

        def block(name: str, turns: int) -> tuple[float, list[float]]:
            """(proxy CPU seconds, per-turn latencies) of one block; the stand-in's own: no CPU read."""
            nonlocal blocks
            blocks += 1
            c = args.concurrency
            spec = {**base, "port": ports[name], "c": c, "turns": TURNS, "sessions_per_worker": max(1, turns // (TURNS * c)),
                    "deadline_s": 600, "tag": f"b{blocks}"}  # fmt: skip
            if name == "standin":
                spec.update(model="standin", session_header=False)
            server = servers.get(name)  # None for the stand-in: its CPU is not the question
            t0 = cpu_seconds(server.pid) if server else 0.0
            out = asyncio.run(loadgen.run(spec))
            spent = cpu_seconds(server.pid) - t0 if server else 0.0
            if out["errors"]:
                raise SystemExit(f"{name}: {out['errors'][:2]}")
            return spent, out["lat"]

        for name in (*sides, "standin"):  # warm-up: connections, first requests, caches
            block(name, 2 * TURNS)
        rounds = []
        for r in range(args.rounds):
            got = {name: [0.0, []] for name in sides}
            order = ("base", "tree", "standin", "tree", "base") if r % 2 == 0 else ("tree", "base", "standin", "base", "tree")
            for name in order:
                spent, lat = block(name, args.turns_per_block // 2)
                if name == "standin":
                    direct = p50(lat)
                    continue
                got[name][0] += spent
                got[name][1] += lat
            row = {name: 1e3 * spent / max(1, len(lat)) for name, (spent, lat) in got.items()}
            row["turns"] = {name: len(lat) for name, (_, lat) in got.items()}
            row["ratio"] = row["tree"] / row["base"]
            row["standin_p50_ms"] = direct
            row["added_p50_ms"] = {name: p50(lat) - direct for name, (_, lat) in got.items()}
            row["added_ratio"] = row["added_p50_ms"]["tree"] / row["added_p50_ms"]["base"]
            rounds.append(row)
            added = row["added_p50_ms"]
            print(f"round {r + 1}/{args.rounds}: base {row['base']:.3f}  tree {row['tree']:.3f} ms/turn  tree/base {row['ratio']:.3f}"
                  f"  |  added p50 base {added['base']:.3f}  tree {added['tree']:.3f} ms  tree/base {row['added_ratio']:.3f}",
                  flush=True)  # fmt: skip
    finally:
        stop_all(procs)
    ratios = [r["ratio"] for r in rounds]
    added = [r["added_ratio"] for r in rounds]
    summary = {
        "base_ms": statistics.median(r["base"] for r in rounds),
        "tree_ms": statistics.median(r["tree"] for r in rounds),
        "ratio_median": statistics.median(ratios),
        "ratio_mean": statistics.mean(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "standin_p50_ms": statistics.median(r["standin_p50_ms"] for r in rounds),
        "base_added_p50_ms": statistics.median(r["added_p50_ms"]["base"] for r in rounds),
        "tree_added_p50_ms": statistics.median(r["added_p50_ms"]["tree"] for r in rounds),
        "added_ratio_median": statistics.median(added),
        "added_ratio_mean": statistics.mean(added),
        "added_ratio_min": min(added),
        "added_ratio_max": max(added),
    }
    return {"bench": "paired", "base": args.base, "tree": args.tree, "concurrency": args.concurrency,
            "base_args": args.base_args, "tree_args": args.tree_args, "rounds": rounds, "summary": summary}  # fmt: skip

