"""How long the sessions table takes to page through a large store: ``python -m proxy.ui.bench_table``.

Writes ``--sessions`` sessions (default 100,000; two or three turns each, rows a few KB wide)
into a fresh store with the store's own schema, in bulk SQL (the proxy's write path would take
long at this size): a third of them fork, a quarter hold an image, half make a side call
(role ``auxiliary``), one in 5,000 runs a sub-agent, one in 50,000 was compacted with no main
turn left, a quarter are rewarded, groups of 8. Then times the first and the next page of 50
for each filter (``proxy.ui.queries.list_sessions``, median of ``--repeat`` runs) and prints a
table. Dense filters (many matches) and sparse ones (a few matches in the whole store) both
walk the ``created_at`` index; neither reads the wide turn rows.
"""

from __future__ import annotations

import argparse
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

from ..store import Store
from ..store.packing import pack_runs
from .queries import SessionFilter, list_sessions

FILTERS = {
    "none": SessionFilter(),
    "role=main": SessionFilter(role="main"),
    "role=auxiliary (half)": SessionFilter(role="auxiliary"),
    "role=subagent (1 in 5,000)": SessionFilter(role="subagent"),
    "role=compacted (1 in 50,000)": SessionFilter(role="compacted"),
    "fork=any (a third)": SessionFilter(fork_reason="*"),
    "fork=history_edited (none)": SessionFilter(fork_reason="history_edited"),
    "images=yes (a quarter)": SessionFilter(has_images=True),
    "images=no": SessionFilter(has_images=False),
    "rewarded=yes": SessionFilter(rewarded=True),
    "group=g7": SessionFilter(group_id="g7"),
    "role=auxiliary, rewarded=yes": SessionFilter(role="auxiliary", rewarded=True),
}


def build(path: str, sessions: int, width: int = 2000) -> None:
    """The synthetic store (see the module doc)."""
    Store(path).close()
    c = sqlite3.connect(path)
    c.execute("INSERT INTO samplings (id, json) VALUES (1, '{}')")
    blob = bytes(width)
    runs = pack_runs([0] * 10)
    srows, trows, irows = [], [], []
    seq = 0
    for k in range(sessions):
        sid = f"s{k:07d}"
        srows.append((sid, f"g{k // 8}", 8, 1.0 if k % 4 == 1 else None, 1000.0 + k))
        roles = ["compacted"] if k % 50_000 == 1 else ["subagent", "main"] if k % 5000 == 0 else ["main", "main"]
        if k % 2 == 0:
            roles.append("auxiliary")
        for i, role in enumerate(roles):
            seq += 1
            fork = "tools_changed" if i == 1 and k % 3 == 0 else None
            trows.append((seq, f"{sid}-{i}", sid, i, blob, blob, runs, fork, 1000.0 + k, role))
            if i == 0 and k % 4 == 0:
                irows.append((seq,))
    c.executemany("INSERT INTO sessions (session_id, group_id, group_size, reward, created_at) VALUES (?, ?, ?, ?, ?)", srows)
    c.executemany(
        "INSERT INTO turns (seq, turn_id, session_id, idx, prompt_base_len, prompt_tail, n_prompt, n_output, output_ids, "
        "logprobs, versions, spliced, fork_reason, finish_reason, created_at, sampling_id, drift, api, response_id, role) "
        "VALUES (?, ?, ?, ?, 0, ?, 10, 10, ?, x'', ?, 0, ?, 'stop', ?, 1, 0, 'chat', 'r', ?)",
        trows,
    )
    c.executemany("INSERT INTO turn_images (turn_seq, refs) VALUES (?, x'')", irows)
    c.commit()
    c.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--limit", type=int, default=50)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="splice-table-") as tmp:
        path = str(Path(tmp) / "s.sqlite")
        t0 = time.perf_counter()
        build(path, args.sessions)
        print(f"{args.sessions} sessions written in {time.perf_counter() - t0:.1f} s\n")
        store = Store(path)
        try:
            print("| filter | rows | first page (ms) | next page (ms) |\n|---|---:|---:|---:|")
            for name, f in FILTERS.items():
                first, nxt, rows = [], [], 0
                for _ in range(args.repeat):
                    t = time.perf_counter()
                    page = list_sessions(store.db, f, version=0, limit=args.limit)
                    first.append(time.perf_counter() - t)
                    rows = len(page["data"])
                    if page["next_cursor"]:
                        t = time.perf_counter()
                        list_sessions(store.db, f, version=0, limit=args.limit, cursor=page["next_cursor"])
                        nxt.append(time.perf_counter() - t)
                ms = lambda xs: f"{1000 * statistics.median(xs):.1f}" if xs else "—"  # noqa: E731
                print(f"| {name} | {rows} | {ms(first)} | {ms(nxt)} |")
        finally:
            store.close()


if __name__ == "__main__":
    main()
