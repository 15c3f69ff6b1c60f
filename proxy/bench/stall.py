"""``splice bench overhead --stall TOKENS``: how far one long render delays everyone else.

Short tool-loop turns run at ``--stall-c`` on the default Splice twice: alone, then beside a
stream of fresh sessions whose first turn carries TOKENS tokens of text (a new text each time,
so each is tokenized and rendered in full). The long turns are planned in a worker thread; what
the short turns' tail shows is whether that thread lets the event loop run meanwhile (the Rust
tokenizer's ``encode`` holds the GIL for the whole call; ``encode_batch`` does not).
"""

from __future__ import annotations

from .tables import format_table


def stall_phases(args, target: dict, base: dict, text: str, tmp: str, standin_pid: int, phase, shape) -> list[dict]:
    """The two phases' stats; ``text``: the long first turns' message (a number goes in front of
    it each time). ``phase``/``shape``: ``proxy.bench.overhead``'s own, passed in."""
    c = args.stall_c
    turns, spw = shape(c, args)
    rows = []
    for beside in (False, True):
        print(f"stall: C={c}, short turns {'beside' if beside else 'without'} {args.stall:,}-token first turns ...", flush=True)
        spec = {**base, "stall": {"text": text, "pause_s": args.stall_pause}} if beside else base
        st = phase(target, c, turns, spw, spec, tmp, args.phase_timeout, standin_pid)
        st["beside"] = beside
        rows.append(st)
    return rows


def print_stall(rows: list[dict], args) -> None:
    out = []
    for r in rows:
        what = f"beside {args.stall:,}-token first turns" if r["beside"] else "alone"
        if not r.get("turns"):
            out.append([what, "failed", "", "", "", "", ""])
            continue
        out.append([what, r["turns"], f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}", f"{r['max_ms']:.1f}",
                    r.get("stall_turns", "") if r["beside"] else "",
                    f"{r['stall_mean_ms']:.0f}" if r.get("stall_turns") else ""])  # fmt: skip
    print(f"\nShort turns at C={args.stall_c} on the default Splice, alone and beside a fresh session's first turn of "
          f"{args.stall:,} tokens (rendered in full in a worker thread) every {args.stall_pause:g} s:")
    print(format_table(["short turns", "turns", "p50 ms", "p99 ms", "max ms", "long turns", "long turn mean ms"], out))
    for r in rows:
        if r.get("n_errors"):
            print(f"stall phase: {r['n_errors']} errors; first: {r['errors'][0][:200]}")
