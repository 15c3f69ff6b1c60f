"""``splice bench recompute``: what R2 costs the engine per weight update (docs/design.md section 4).

For each T in ``--turns``: ``--sessions`` tool-using Chat sessions of T turns, each tool result
about ``--tokens`` tokens long, are held across one weight update (pause, update_weights,
resume), then either stay **idle** or **continue** with one more turn each; then the next pause
comes (the R2 deadline). The engine stand-in (``standin.py``, its own process) counts what it was
asked for: prefill-only calls and the tokens they sent, and turns that asked for input logprobs
of their prompt. A prefill-only call costs ``len / --prefill-tok-s`` seconds of stand-in time (a
modelled engine speed; turns cost nothing), so the time the next pause waits is the queue of
prefills the proxy still owes at that moment.

``--before-src DIR`` also runs every case against another Splice source tree (e.g. an export of
an older release: ``git archive <commit> | tar -x -C DIR``) for a before/after table. Each case
starts a fresh stand-in and ``splice serve``.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

from engines.reference.launch import free_port

from .stack import HERE, REPLY_TEXT, stop_all, wait_http
from .tables import format_table as _table
from .workload import SYSTEM, TOOL, USER


def add_parser(sub) -> None:
    p = sub.add_parser("recompute", help="R2 per update: prefill calls and tokens, pause wait (idle / continuing sessions)")
    p.add_argument("--turns", type=int, nargs="+", default=[4, 16, 64], help="turns per session (T)")
    p.add_argument("--tokens", type=int, default=128, help="tokens per tool result (L)")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--prefill-tok-s", type=float, default=20000.0, help="modelled engine speed of a prefill-only call")
    p.add_argument("--before-src", metavar="DIR", help="another Splice source tree to compare with (the 'before' rows)")
    p.add_argument("--modes", nargs="+", default=["idle", "continuing"], choices=["idle", "continuing"])
    p.add_argument("--out")


def _start(tmp: str, src: str, tok, tok_dir: str, prefill_tok_s: float, procs: list) -> tuple[str, str]:
    spec = os.path.join(tmp, "standin.json")
    out_ids = list(tok.encode(REPLY_TEXT, add_special_tokens=False))
    with open(spec, "w") as f:
        json.dump({"out_ids": out_ids, "stop_id": tok.convert_tokens_to_ids("<|im_end|>"), "reasoning": "I should call f.",
                   "tool_call": {"name": "f", "arguments": '{"x": 1}'}, "prefill_tok_per_s": prefill_tok_s}, f)  # fmt: skip
    sport = free_port()
    procs.append(subprocess.Popen([sys.executable, str(HERE / "standin.py"), str(sport), spec]))
    surl = f"http://127.0.0.1:{sport}"
    if why := wait_http(surl + "/health", procs[-1]):
        raise SystemExit(f"engine stand-in: {why}")
    pport = free_port()
    env = {**os.environ, "PYTHONPATH": src, "SPLICE_QUIET": "1"}  # no per-turn console lines (an older tree ignores it)
    procs.append(subprocess.Popen(
        [sys.executable, "-c", "import sys; from proxy.cli import main; sys.exit(main(sys.argv[1:]))",
         "serve", "--engine", "sglang", "--engine-url", surl, "--tokenizer", tok_dir, "--renderer", "qwen3",
         "--store", os.path.join(tmp, "splice.sqlite"), "--host", "127.0.0.1", "--port", str(pport),
         "--max-context", "32768", "--drift-check", "off"], env=env, cwd=src,
    ))  # fmt: skip
    purl = f"http://127.0.0.1:{pport}"
    if why := wait_http(purl + "/v1/models", procs[-1]):
        raise SystemExit(f"splice serve ({src}): {why}")
    return surl, purl


async def _case(surl: str, purl: str, turns: int, tokens: int, sessions: int, mode: str) -> dict:
    tool_text = " ".join(["data"] * tokens)
    from proxy.auth import local_admin_headers

    async with httpx.AsyncClient(base_url=purl, timeout=600, headers=local_admin_headers()) as c, httpx.AsyncClient(base_url=surl, timeout=60) as e:

        async def turn(name: str, msgs: list[dict]) -> float:
            t0 = time.perf_counter()
            r = await c.post("/v1/chat/completions", headers={"X-Session-Id": name},
                             json={"messages": msgs, "tools": [{"type": "function", "function": TOOL}], "max_tokens": 256})  # fmt: skip
            if r.status_code != 200:  # e.g. a prompt past the stand-in's context: say what the proxy said
                raise SystemExit(f"splice bench recompute: turn of {name}: HTTP {r.status_code}: {r.text[:300]}")
            m = r.json()["choices"][0]["message"]
            msgs.append({k: v for k, v in m.items() if v is not None and k in ("role", "content", "tool_calls", "reasoning_content")})
            msgs.append({"role": "tool", "tool_call_id": m["tool_calls"][0]["id"], "content": tool_text})
            return time.perf_counter() - t0

        async def session(name: str) -> list[dict]:
            msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
            for _ in range(turns):
                await turn(name, msgs)
            return msgs

        names = [f"s{turns}-{mode}-{i}" for i in range(sessions)]
        histories = await asyncio.gather(*(session(n) for n in names))
        before = (await e.get("/stats")).json()
        for path, body in (("/admin/pause", {}), ("/admin/update_weights", {"model_path": "/ckpt/v1", "version": 1}), ("/admin/resume", {})):
            (await c.post(path, json=body)).raise_for_status()
        lat: list[float] = []
        if mode == "continuing":  # one at a time: the latency of a next turn, not of a queue
            for n, h in zip(names, histories):
                lat.append(await turn(n, h))
        t0 = time.perf_counter()
        paused = await c.post("/admin/pause", json={})
        pause_wait = time.perf_counter() - t0
        paused.raise_for_status()
        after = (await e.get("/stats")).json()
        for path, body in (("/admin/update_weights", {"model_path": "/ckpt/v2", "version": 2}), ("/admin/resume", {})):
            (await c.post(path, json=body)).raise_for_status()
        d = {k: after[k] - before[k] for k in before}
        stages = _stages((await c.get("/metrics")).text)
        return {
            "turns": turns, "tokens": tokens, "sessions": sessions, "mode": mode,
            "prefill_calls": d["prefill_calls"], "prefill_calls_per_session": d["prefill_calls"] / sessions,
            "prefill_tokens": d["prefill_tokens"], "turns_with_input_logprobs": d["turns_with_input_logprobs"],
            "input_logprob_tokens": d["input_logprob_tokens"], "pause_wait_s": pause_wait,
            "next_turn_p50_ms": statistics.median(lat) * 1e3 if lat else None,
            "missing_tokens": (paused.json().get("recompute") or {}).get("missing_tokens"),
            "stage_ms": stages,
        }  # fmt: skip


def _stages(text: str) -> dict[str, float]:
    """Mean ms per turn of the proxy's stages, from /metrics (sum / count per stage label)."""
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for line in text.splitlines():
        for suffix, into in (("_sum{", sums), ("_count{", counts)):
            if line.startswith("splice_stage_seconds" + suffix):
                label = line.split('stage="', 1)[1].split('"', 1)[0]
                into[label] = float(line.rsplit(" ", 1)[1])
    return {k: round(1e3 * sums[k] / counts[k], 3) for k in sums if counts.get(k)}


def run(args) -> dict:
    from tokenization import load_tokenizer, qwen3_tokenizer_dir

    tok_dir = str(qwen3_tokenizer_dir())
    tok = load_tokenizer(tok_dir)
    sources = [("after", str(HERE.parents[1]))]
    if args.before_src:
        sources.insert(0, ("before", os.path.abspath(args.before_src)))
    rows: list[dict] = []
    for turns in args.turns:
        for mode in args.modes:
            for label, src in sources:
                procs: list[subprocess.Popen] = []
                tmp = tempfile.mkdtemp(prefix="splice_bench_recompute_")
                try:
                    surl, purl = _start(tmp, src, tok, tok_dir, args.prefill_tok_s, procs)
                    res = asyncio.run(_case(surl, purl, turns, args.tokens, args.sessions, mode))
                finally:
                    stop_all(procs)
                res["source"] = label
                rows.append(res)
                print(f"{label} T={turns} {mode}: {res['prefill_calls']} prefills ({res['prefill_tokens']} tokens), "
                      f"pause waited {res['pause_wait_s']:.2f} s", flush=True)  # fmt: skip
    print()
    print(_table(
        ["source", "T", "L", "mode", "sessions", "prefill calls", "per session", "prefilled tokens", "turns w/ input lp",
         "pause wait s", "next turn p50 ms"],
        [[r["source"], r["turns"], r["tokens"], r["mode"], r["sessions"], r["prefill_calls"], f"{r['prefill_calls_per_session']:.1f}",
          r["prefill_tokens"], r["turns_with_input_logprobs"], f"{r['pause_wait_s']:.2f}",
          "-" if r["next_turn_p50_ms"] is None else f"{r['next_turn_p50_ms']:.1f}"] for r in rows],
    ))  # fmt: skip
    print(f"\nmodelled prefill speed: {args.prefill_tok_s:.0f} tokens/s per prefill-only call (stand-in sleeps len/rate)")
    return {"prefill_tok_s": args.prefill_tok_s, "rows": rows}
