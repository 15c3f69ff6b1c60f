"""``splice bench pull`` runs end to end (small sizes): both formats hand back the whole sample,
Arrow takes fewer bytes per token, and the report has every figure (no timing is asserted)."""

from __future__ import annotations

import json

from proxy.cli import main as splice


def test_bench_pull_small(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "pull.json"
    assert splice(["bench", "pull", "--sizes", "500", "2000", "--turn-tokens", "250", "--reps", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    sizes = [(r["tokens"], r["sampled"]) for r in report["results"]]
    assert sizes == [(500, 0.2), (2000, 0.2), (2000, 1.0)]
    for r in report["results"]:
        assert r["arrow"]["bytes_per_token"] < r["json"]["bytes_per_token"]
    rss = report["rss_one_sample"]
    assert rss["tokens"] == 2000 and all(rss[f"{w}_{f}_peak_mb"] > 0 for w in ("proxy", "trainer") for f in ("json", "arrow"))
    assert "parse speed-up" in capsys.readouterr().out
