"""``python -m proxy.bench.http_body`` runs end to end (small sizes): a real uvicorn server with
Splice's protocol reads every body whole and the table has a row per size (no timing asserted)."""

from __future__ import annotations

from proxy.bench import http_body


def test_bench_http_body_small(capsys):
    assert http_body.main(["--sizes", "1000", "300000", "--requests", "20", "--rounds", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["source", "body", "bytes"]
    rows = [line.split() for line in lines[2:]]
    assert [r[1] for r in rows] == ["1,000", "300,000"]  # measure() waits for the byte count it sent
    assert all(float(r[2]) > 0 and float(r[3]) >= 0 for r in rows)
