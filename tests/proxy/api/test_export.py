"""``splice export``: Parquet files that the real ``datasets`` library loads, one row per sample
with the schema's columns and values, from a store file or a running proxy; nothing is leased
or acked unless ``--consume`` asks for it."""

from __future__ import annotations

import datasets
import pytest

from proxy.cli import main as splice
from tests.proxy.api.samples_fixture import ARRAYS, check_expected, proxy  # noqa: F401 - fixture


def load(out) -> list[dict]:
    ds = datasets.load_dataset("parquet", data_files=str(out / "*.parquet"), split="train", cache_dir=str(out.parent / "hf-cache"))
    feats = ds.features
    assert feats["input_ids"].feature.dtype == "int32" and feats["versions"].feature.dtype == "int32"
    assert feats["logprobs"].feature.dtype == "float32" and feats["loss_mask"].feature.dtype == "uint8"
    return sorted(ds, key=lambda r: r["sample_id"])


def test_store_file_round_trips_through_datasets(proxy, tmp_path):
    out = tmp_path / "from-store"
    assert splice(["export", "--store", proxy.store.path, "--out", str(out)]) == 0
    rows = load(out)
    check_expected(rows)
    assert set(rows[0]) >= set(ARRAYS) | {"schema_version", "turns", "turn_ids", "rewarded_at", "reward", "group_id"}
    assert proxy.store.stats()["sessions_leased"] == 0 and proxy.store.stats()["sessions_acked"] == 0


def test_proxy_export_leases_nothing_and_filters(proxy, tmp_path):
    out = tmp_path / "all"
    assert splice(["export", "--proxy", proxy.url, "--out", str(out)]) == 0
    check_expected(load(out))
    assert proxy.store.stats()["sessions_leased"] == 0
    late = tmp_path / "late"
    assert splice(["export", "--proxy", proxy.url, "--out", str(late), "--since", "1970-01-01T00:16:41.5"]) == 0  # 1001.5 s
    assert [r["sample_id"] for r in load(late)] == ["b:0"]
    lease, samples = proxy.store.pool.pull(10, 10.0)  # the trainer still gets everything
    assert len(samples) == 3
    proxy.store.pool.ack(lease)
    none = tmp_path / "none"
    assert splice(["export", "--store", proxy.store.path, "--out", str(none)]) == 0
    assert not list(none.glob("*.parquet"))  # acked sessions are left out unless --acked
    again = tmp_path / "acked"
    assert splice(["export", "--store", proxy.store.path, "--out", str(again), "--acked"]) == 0
    check_expected(load(again))


def test_consume_pulls_and_acks(proxy, tmp_path):
    out = tmp_path / "consumed"
    assert splice(["export", "--proxy", proxy.url, "--out", str(out), "--consume"]) == 0
    check_expected(load(out))
    assert proxy.store.stats()["sessions_acked"] == 2
    assert proxy.store.pool.pull(10, 10.0) == (None, [])


def test_bad_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit):
        splice(["export", "--store", "x.db", "--out", str(tmp_path), "--consume"])
    with pytest.raises(SystemExit):
        splice(["export", "--out", str(tmp_path)])
    capsys.readouterr()
    assert splice(["export", "--store", str(tmp_path / "missing.db"), "--out", str(tmp_path / "o")]) == 2  # one line, no traceback
    assert capsys.readouterr().err.strip() == f"splice export: no store file at {tmp_path / 'missing.db'}"
