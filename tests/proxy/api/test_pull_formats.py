"""The pull over real HTTP in both formats: JSON and the Arrow IPC stream carry identical values,
both validate against the versioned sample schema (proxy/schemas/sample.schema.json), and the
trainer's client reads the Arrow answer into the same values.

The expected arrays are written out by hand from the turns (``samples_fixture``); Arrow is decoded
with pyarrow's own reader, JSON with the standard library.
"""

from __future__ import annotations

import httpx
import numpy as np
import pyarrow as pa
import pytest
from jsonschema import Draft202012Validator

from proxy.api.training import wants_arrow
from tests.proxy.api.samples_fixture import ARRAYS, LEASE_S, SCHEMA, check_expected, proxy  # noqa: F401 - fixture
from trainer_bridge.client import ProxyClient

ARROW = "application/vnd.apache.arrow.stream"


def arrow_rows(content: bytes) -> tuple[dict[str, str], list[dict]]:
    reader = pa.ipc.open_stream(content)
    meta = {k.decode(): v.decode() for k, v in reader.schema.metadata.items()}
    table = reader.read_all()
    for name, typ in (("input_ids", pa.int32()), ("versions", pa.int32()), ("proximal_versions", pa.int32()),
                      ("logprobs", pa.float32()), ("proximal_logprobs_t", pa.float32()), ("loss_mask", pa.uint8())):
        assert table.schema.field(name).type == pa.list_(typ), name  # fmt: skip
    return meta, table.to_pylist()


def test_json_and_arrow_carry_identical_values_and_validate(proxy):
    validator = Draft202012Validator(SCHEMA)
    r = httpx.post(proxy.url + "/v1/trajectories/pull", json={"max_samples": 10})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    body = r.json()
    validator.validate(body)
    assert body["schema_version"] == 3 and body["dropped_stale"] == 0 and body["lease_id"].startswith("lease_")
    check_expected(body["samples"])

    proxy.clock.t += LEASE_S + 1  # the JSON lease expires unacked: the same samples come back
    r = httpx.post(proxy.url + "/v1/trajectories/pull", json={"max_samples": 10}, headers={"Accept": ARROW})
    assert r.status_code == 200 and r.headers["content-type"] == ARROW
    meta, rows = arrow_rows(r.content)
    assert meta["splice.schema_version"] == "3" and meta["splice.dropped_stale"] == "0"
    assert meta["splice.lease_id"] == r.headers["x-splice-lease-id"] != body["lease_id"]
    as_json = {"schema_version": int(meta["splice.schema_version"]), "lease_id": meta["splice.lease_id"],
               "samples": rows, "dropped_stale": int(meta["splice.dropped_stale"])}  # fmt: skip
    validator.validate(as_json)
    check_expected(rows)
    for j, a in zip(body["samples"], rows):  # identical values, field by field (float32 both ways)
        assert set(j) == set(a)
        for key in j:
            if key in ("logprobs", "proximal_logprobs_t"):
                assert np.array_equal(np.asarray(j[key], np.float32), np.asarray(a[key], np.float32))
            else:
                assert j[key] == a[key], key
    assert httpx.post(proxy.url + "/v1/trajectories/ack", json={"lease_id": meta["splice.lease_id"]}).status_code == 200
    empty = httpx.post(proxy.url + "/v1/trajectories/pull", json={"max_samples": 10}, headers={"Accept": ARROW})
    meta, rows = arrow_rows(empty.content)
    assert rows == [] and "splice.lease_id" not in meta


def test_trainer_client_reads_arrow_into_numpy(proxy):
    with ProxyClient(proxy.url) as c:
        lease, samples = c.pull(10)
    check_expected(samples)
    s = samples[0]
    assert s["input_ids"].dtype == np.int32 and s["logprobs"].dtype == np.float32 and s["loss_mask"].dtype == np.uint8
    assert s["input_ids"].flags.writeable and c.last_pull["schema_version"] == 3 and c.last_pull["dropped_stale"] == 0
    proxy.clock.t += LEASE_S + 1
    with ProxyClient(proxy.url, arrow=False) as c:
        lease2, json_samples = c.pull(10)
        c.ack(lease2)
    assert lease2 != lease
    for a, j in zip(samples, json_samples):
        assert all(np.array_equal(a[k], np.asarray(j[k], a[k].dtype)) for k in ARRAYS)


def test_sample_page_leases_nothing(proxy):
    r = httpx.get(proxy.url + "/v1/trajectories/samples", params={"limit": 1}, headers={"Accept": ARROW})
    meta, rows = arrow_rows(r.content)
    assert [s["sample_id"] for s in rows] == ["a:0", "a:1"] and "splice.next_cursor" in meta
    r = httpx.get(proxy.url + "/v1/trajectories/samples", params={"limit": 1, "cursor": meta["splice.next_cursor"]})
    page = r.json()
    assert [s["sample_id"] for s in page["samples"]] == ["b:0"] and page["has_more"] is False
    Draft202012Validator({**SCHEMA, "$ref": "#/$defs/page"}).validate(page)
    assert proxy.store.stats()["sessions_leased"] == 0
    lease, samples = proxy.store.pool.pull(10, 10.0)
    assert len(samples) == 3  # still all there for the trainer
    proxy.store.pool.ack(lease)
    assert httpx.get(proxy.url + "/v1/trajectories/samples").json()["samples"] == []
    assert len(httpx.get(proxy.url + "/v1/trajectories/samples", params={"acked": "true"}).json()["samples"]) == 3
    assert httpx.get(proxy.url + "/v1/trajectories/samples", params={"since": 1001.5, "acked": "true"}).json()["samples"][0]["sample_id"] == "b:0"
    bad = httpx.get(proxy.url + "/v1/trajectories/samples", params={"cursor": "nope"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_value"


@pytest.mark.parametrize(
    "accept, arrow",
    [
        (None, False),
        ("application/json", False),
        ("*/*", False),
        (ARROW, True),
        (f"{ARROW}, application/json;q=0.5", True),
        (f"application/json, {ARROW.upper()};q=0.9", True),
        (f"{ARROW};q=0", False),
        (f"{ARROW};q=bogus", True),
    ],
)
def test_accept_header_picks_the_format(accept, arrow):
    assert wants_arrow(accept) is arrow
