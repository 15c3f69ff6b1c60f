"""``splice bench paired`` runs end to end (small sizes): two trees served side by side take
turns in ABBA blocks, each block's proxy CPU is counted, and the rounds give ratios (no timing
is asserted: this tree against itself, with a flag that changes what it does per turn). Each
round also times the stand-in alone, and gives each tree's added p50 against it."""

from __future__ import annotations

import json
from pathlib import Path

from proxy.bench.paired import cpu_seconds
from proxy.cli import main as splice

REPO = Path(__file__).resolve().parents[2]


def test_bench_paired_small(tmp_path, capsys):
    out = tmp_path / "paired.json"
    args = ["bench", "paired", "--base", str(REPO), "--rounds", "2", "--turns-per-block", "24",
            "--tree-args", "--drift-check off", "--out", str(out)]  # fmt: skip
    assert splice(args) == 0
    result = json.loads(out.read_text())
    assert result["tree_args"] == "--drift-check off" and len(result["rounds"]) == 2
    for row in result["rounds"]:
        assert row["turns"] == {"base": 24, "tree": 24}  # two blocks of one 12-turn session each
        assert row["base"] > 0 and row["tree"] > 0 and abs(row["ratio"] - row["tree"] / row["base"]) < 1e-9
        added = row["added_p50_ms"]
        # a turn through a proxy takes longer than the same turn at the stand-in alone
        assert row["standin_p50_ms"] > 0 and added["base"] > 0 and added["tree"] > 0
        assert abs(row["added_ratio"] - added["tree"] / added["base"]) < 1e-9
    s = result["summary"]
    assert s["ratio_min"] <= s["ratio_median"] <= s["ratio_max"]
    assert s["added_ratio_min"] <= s["added_ratio_median"] <= s["added_ratio_max"]
    printed = capsys.readouterr().out
    assert "round 2/2" in printed and "tree / base (median)" in printed and "added p50 ms" in printed


def test_cpu_seconds_counts_every_live_thread_of_a_process():
    import os
    import threading

    before = cpu_seconds(os.getpid())
    spun, stop = threading.Event(), threading.Event()

    def spin():
        x = 0
        for i in range(2_000_000):
            x += i
        spun.set()
        stop.wait(30)  # still alive when counted (a thread that has ended is no longer listed)

    t = threading.Thread(target=spin)
    t.start()
    spun.wait(30)
    try:
        assert cpu_seconds(os.getpid()) - before > 0.01  # the other thread's time is in the total
    finally:
        stop.set()
        t.join()
