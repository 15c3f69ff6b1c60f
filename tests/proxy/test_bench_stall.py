"""``splice bench overhead --stall`` runs end to end (small sizes): short turns alone, then beside
long first turns that reach the proxy and are answered (no timing is asserted)."""

from __future__ import annotations

import json

from proxy.cli import main as splice


def test_bench_overhead_stall_small(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "overhead.json"
    args = ["bench", "overhead", "-c", "1", "--no-litellm", "--min-turns", "24", "--stall", "3000", "--stall-c", "2",
            "--stall-pause", "0.01", "--out", str(out)]  # fmt: skip
    assert splice(args) == 0
    alone, beside = json.loads(out.read_text())["stall"]
    assert not alone["beside"] and beside["beside"]
    assert alone["turns"] == beside["turns"] > 0 and alone["n_errors"] == beside["n_errors"] == 0
    assert "stall_turns" not in alone and beside["stall_turns"] >= 1 and beside["stall_mean_ms"] > 0
    assert alone["max_ms"] >= alone["p99_ms"] >= alone["p50_ms"] > 0
    printed = capsys.readouterr().out
    assert "beside 3,000-token first turns" in printed and "long turn mean ms" in printed
