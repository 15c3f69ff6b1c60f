"""``python -m proxy.bench.resent_lookup``: how long a long request takes to find its own
conversation among header-less look-alikes (``HistoryMemo.resent``).

Header-less sessions of one system prompt share a bucket of the history memo. Each keeps a
conversation of 3 tool-call turns (a 20 KB tool result, so its requests are parsed from what
they add); then each sends its next request and the time of ``HistoryMemo.resent`` alone is
measured (the fastest of five tries), the median and the slowest over the sessions. Two kinds
of first answer:

- ``text``: the answer starts with sampled text, different in every session;
- ``call``: the answer is a tool call with no text, its id Splice's (``call_<turn id>_0``,
  time-ordered: sessions started together share its first digits).

``--tasks`` spreads the sessions over that many tasks (user messages of different lengths). ``--src DIR``
(repeatable) measures the ``proxy`` package of another checkout (a ``git worktree`` of an older
release) in its own process, for a before / after on the same machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from .tables import format_table

CHILD = r"""
import json, secrets, statistics, sys, time
sys.path.insert(0, sys.argv[1])
import orjson
from proxy.api.chat import _message_converter, keepable
from proxy.api.history_memo import HistoryMemo, convert, read_body

n, tasks, kind = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
SYSTEM = "You are a coding agent working in a sandboxed repository. " * 20
DOC = "def f(x):\n    return x * 2  # line 12345\n" * 500

def answer(s, t):
    call_id = f"call_{time.time_ns() // 1_000_000 & 0xFF_FFFF_FFFF:010x}{secrets.token_hex(7)}_0"
    call = {"id": call_id, "type": "function", "function": {"name": "read_file", "arguments": '{"path": "src/app.py"}'}}
    text = None if kind == "call" else f"{secrets.token_hex(6)} Let me read the file that fails first."
    return {"role": "assistant", "content": text, "tool_calls": [call]}, call_id

def send(memo, msgs):
    raw = orjson.dumps({"model": "m", "messages": msgs, "max_tokens": 256})
    body, found = read_body(raw, memo, "chat", None)
    conv = convert(body["messages"], _message_converter(None), found.reuse)
    memo.keep(found.key, body["messages"], None, conv, found.reuse, found.cost, keepable, found.layout)

memo = HistoryMemo()
sessions = []
for s in range(n):
    task = f"Task {s % tasks}: make the failing test in tests/test_app.py pass." + " Details follow." * (s % tasks)
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]
    for t in range(3):
        a, cid = answer(s, t)
        msgs += [a, {"role": "tool", "tool_call_id": cid, "content": DOC if t == 0 else f"ok {t}"}]
        send(memo, msgs)
    sessions.append(msgs)
times = []
for msgs in sessions:
    a, cid = answer(0, 3)
    raw = orjson.dumps({"model": "m", "messages": msgs + [a, {"role": "tool", "tool_call_id": cid, "content": "ok"}], "max_tokens": 256})
    start = raw.find(b'"messages":[') + 11
    best = None
    for _ in range(5):  # the fastest of five: the look-up, not the machine's moment
        t0 = time.perf_counter_ns()
        hit = memo.resent(raw, start, "chat", None, "messages")
        t = time.perf_counter_ns() - t0
        best = t if best is None else min(best, t)
        assert hit is not None, "not found"
    times.append(best)
print(json.dumps({"median_us": statistics.median(times) / 1e3, "max_us": max(times) / 1e3}))
"""


def measure(src: str, n: int, tasks: int, kind: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, src, str(n), str(tasks), kind], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m proxy.bench.resent_lookup", description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--tasks", type=int, default=1)
    p.add_argument("--kind", choices=["text", "call"], nargs="+", default=["text", "call"])
    p.add_argument("--src", action="append", help="another checkout's root (default: this one)")
    p.add_argument("--out", default="bench_resent_lookup.json")
    args = p.parse_args(argv)
    srcs = args.src or [str(Path(__file__).resolve().parents[2])]
    rows, results = [], []
    for kind in args.kind:
        for n in args.sessions:
            for src in srcs:
                r = {"src": src, "kind": kind, "sessions": n, "tasks": args.tasks, **measure(src, n, args.tasks, kind)}
                results.append(r)
                rows.append([src, kind, n, f"{r['median_us']:.1f}", f"{r['max_us']:.1f}"])
                print(f"{kind} {n} sessions {src}: {r['median_us']:.1f} us", file=sys.stderr, flush=True)
    print(f"\nHistoryMemo.resent per request, header-less sessions of one system prompt over {args.tasks} task(s):")
    print(format_table(["tree", "first answer", "sessions", "median us", "max us"], rows))
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
