"""``splice bench images`` runs end to end (small): every image sent is stored once per hash, the
store holds about one PNG per image-turn, and the report has every figure (no timing is asserted)."""

from __future__ import annotations

import json

from proxy.cli import main as splice


def test_bench_images_small(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "images.json"
    args = ["bench", "images", "--turns", "3", "--reps", "1", "--width", "320", "--height", "200", "--out", str(out)]
    assert splice(args) == 0
    r = json.loads(out.read_text())
    assert r["sent_images"] == 1 + (1 + 2 + 3) and r["stored_images"] == r["image_turns"] == 1 + 3
    assert r["tokens_per_image"] == r["grid_thw"][1] * r["grid_thw"][2] // 4
    assert r["image_table_bytes"] <= r["bytes_per_image_turn"] * r["image_turns"] * 1.5
    assert len(r["added_s"]) == 3 and all(t > 0 for t in r["images_s"])
    assert "per image-turn" in capsys.readouterr().out
