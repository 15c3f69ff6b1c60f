"""``splice bench store`` runs end to end (small sizes) and reports a stored size far below the
flat layout's (no timing is asserted)."""

from __future__ import annotations

import json

from proxy.cli import main as splice


def test_bench_store_small(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "store.json"
    assert splice(["bench", "store", "--sessions", "3", "--turns", "4", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["generated_tokens"] == 3 * 4 * report["output_tokens_per_turn"]
    assert 0 < report["bytes_per_generated_token"] < report["naive_bytes_per_generated_token"]
