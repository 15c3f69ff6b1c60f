"""``python -m proxy.bench.engine_parse``: CPU to parse an SGLang ``/generate`` reply, by size.

Replies are built as SGLang sends them (``meta_info`` with ``[logprob, id, null]`` entries):
output tokens of a turn (24, 900, 4,000) and input positions of a prefill or of a turn that
carries owed values (11,000, 100,000). Each row times ``engines.sglang.parse_response`` on the
decoded body and, for scale, ``orjson.loads`` of the body; medians of ``--rounds``, with the
collector's threshold the proxy runs with. ``--src DIR`` (repeatable) times the parser of
another checkout too, in a child process, so before and after share one table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time

CASES = (("output", 24), ("output", 900), ("output", 4000), ("input", 11_000), ("input", 100_000))


def _body(kind: str, n: int) -> tuple[bytes, list[int], int]:
    """An SGLang reply body with ``n`` output entries or ``n`` input positions, its prompt and start."""
    import orjson

    rng = random.Random(n)
    start = 10
    prompt = [rng.randrange(150_000) for _ in range(start + (n if kind == "input" else 300))]
    inputs = [[None if j == 0 else -rng.random() * 5, prompt[start + j], None] for j in range(n)] if kind == "input" else []
    outputs = [[-rng.random() * 3, rng.randrange(150_000), None] for _ in range(n if kind == "output" else 24)]
    meta = {
        "id": "r", "finish_reason": {"type": "stop", "matched": 151645}, "prompt_tokens": len(prompt),
        "completion_tokens": len(outputs), "cached_tokens": 0, "weight_version": "0",
        "input_token_logprobs": inputs, "output_token_logprobs": outputs,
    }  # fmt: skip
    return orjson.dumps({"text": "", "output_ids": [e[1] for e in outputs], "meta_info": meta}), prompt, start if inputs else -1


def _median_us(fn, reps: int, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - t0) / reps * 1e6)
    return statistics.median(times)


def measure(rounds: int, cases=CASES) -> list[dict]:
    import orjson

    from engines.sglang import parse_response

    gc.set_threshold(50_000, 20, 10)  # the proxy's (proxy/app.py)
    rows = []
    for kind, n in cases:
        body, prompt, start = _body(kind, n)
        reply = orjson.loads(body)
        reps = max(10, 300_000 // (n + 300))
        rows.append({
            "kind": kind, "n": n,
            "parse_us": _median_us(lambda: parse_response(reply, prompt, start, "bench"), reps, rounds),
            "json_us": _median_us(lambda: orjson.loads(body), reps, rounds),
        })  # fmt: skip
    return rows


def _measure_in(src: str, rounds: int, cases) -> list[dict]:
    """``measure`` with the ``engines`` package of the checkout ``src``."""
    code = (
        "import json, sys, importlib.util\n"
        f"sys.path.insert(0, {os.path.abspath(src)!r})\n"
        f"spec = importlib.util.spec_from_file_location('engine_parse', {os.path.abspath(__file__)!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        f"print(json.dumps(m.measure({rounds}, {list(cases)!r})))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=src)
    if proc.returncode != 0:
        raise SystemExit(f"timing the parser of {src} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m proxy.bench.engine_parse", description=__doc__.split("\n\n")[0])
    p.add_argument("--src", action="append", default=[], help="another checkout whose parser to time as well")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cases", nargs="+", metavar="KIND:N", help="e.g. output:900 input:11000 (default: the five above)")
    args = p.parse_args(argv)
    from .tables import format_table  # here: a child loads this file alone (``_measure_in``)

    cases = CASES if not args.cases else [(c.split(":")[0], int(c.split(":")[1])) for c in args.cases]
    if any(kind not in ("output", "input") for kind, _ in cases):
        p.error("--cases: KIND is output or input")
    tables = [(src, _measure_in(src, args.rounds, cases)) for src in args.src]
    tables.append(("this checkout", measure(args.rounds, cases)))
    header = ["entries", *[f"parse µs ({name})" for name, _ in tables], "orjson.loads µs"]
    body = []
    for i, (kind, n) in enumerate(cases):
        body.append([f"{n:,} {kind}", *[f"{rows[i]['parse_us']:.1f}" for _, rows in tables], f"{tables[-1][1][i]['json_us']:.1f}"])
    print(format_table(header, body))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
