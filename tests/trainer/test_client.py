"""ProxyClient wire format (docs/design.md section 7), retries and errors, against respx-mocked proxies."""

from __future__ import annotations

import json

import httpx
import pytest
import respx

from trainer_bridge import client as client_mod
from trainer_bridge.client import ProxyClient, ProxyError

URL = "http://proxy.test"
URL2 = "http://proxy2.test"


@pytest.fixture(autouse=True)
def no_sleep(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(client_mod.time, "sleep", slept.append)
    return slept


def body(route, k=-1):
    return json.loads(route.calls[k].request.content)


@respx.mock
def test_pull_and_ack_bodies_and_bearer():
    sample = {"sample_id": "x", "input_ids": [1, 2]}
    pull = respx.post(f"{URL}/v1/trajectories/pull").respond(200, json={"schema_version": 3, "lease_id": "L1", "samples": [sample]})
    ack = respx.post(f"{URL}/v1/trajectories/ack").respond(200, json={"ok": True})
    c = ProxyClient(URL + "/", admin_token="sekret")
    lease, samples = c.pull(4, 2.5)
    assert (lease, samples) == ("L1", [sample])
    assert body(pull) == {"max_samples": 4, "wait_s": 2.5}
    assert pull.calls[0].request.headers["authorization"] == "Bearer sekret"
    c.ack(lease)
    assert body(ack) == {"lease_id": "L1"}
    assert ack.calls[0].request.headers["authorization"] == "Bearer sekret"


@respx.mock
def test_no_token_no_header_and_empty_pull():
    pull = respx.post(f"{URL}/v1/trajectories/pull").respond(200, json={"schema_version": 3, "lease_id": None, "samples": []})
    lease, samples = ProxyClient(URL).pull(8)
    assert lease is None and samples == []
    assert "authorization" not in pull.calls[0].request.headers


@respx.mock
def test_publish_is_pause_update_resume_on_every_proxy():
    # (the fleet protocol in full: tests/trainer/test_publish.py)
    order = []
    for k, base in enumerate((URL, URL2)):
        status = {"version": 0, "engines": {"engine_replicas": [{"id": f"http://engine-{k}:30000", "healthy": True}]}}
        respx.get(f"{base}/admin/status").respond(200, json=status)
        for path in ("/admin/pause", "/admin/update_weights", "/admin/resume", "/admin/version"):
            respx.post(f"{base}{path}").mock(
                side_effect=lambda req, base=base, path=path: order.append((base, path, req.content)) or httpx.Response(200, json={})
            )
    c = ProxyClient([URL, URL2], admin_token="t")
    c.publish("/ckpt/step_3", 7)
    phases = [p for _, p, _ in order]
    assert sorted(phases[:2]) == ["/admin/pause"] * 2 and phases[2:4] == ["/admin/update_weights"] * 2
    assert phases[4:] == ["/admin/resume"] * 2 and {b for b, _, _ in order[4:]} == {URL, URL2}
    assert json.loads(order[2][2]) == {"model_path": "/ckpt/step_3", "version": 7, "engines": [f"http://engine-{0 if order[2][0] == URL else 1}:30000"]}
    order.clear()
    c.set_version(9)
    assert [(b, p, json.loads(x)) for b, p, x in order] == [
        (URL, "/admin/version", {"version": 9}), (URL2, "/admin/version", {"version": 9})
    ]


@respx.mock
def test_failed_update_still_resumes():
    respx.get(f"{URL}/admin/status").respond(200, json={"engines": {"engine_replicas": [{"id": "http://e:1", "healthy": True}]}})
    respx.post(f"{URL}/admin/pause").respond(200, json={})
    respx.post(f"{URL}/admin/update_weights").respond(
        400, json={"error": {"message": "no such directory", "type": "invalid_request_error", "code": "bad_path"}}
    )
    resume = respx.post(f"{URL}/admin/resume").respond(200, json={})
    with pytest.raises(ProxyError, match="no such directory") as info:
        ProxyClient(URL).publish("/nope", 1)
    assert info.value.status == 400 and info.value.code == "bad_path"
    assert resume.called


@respx.mock
def test_retry_on_503_honours_retry_after(no_sleep):
    route = respx.post(f"{URL}/v1/trajectories/pull").mock(
        side_effect=[
            httpx.Response(503, headers={"Retry-After": "7"}, json={"error": {"message": "busy", "type": "server_error", "code": None}}),
            httpx.Response(429, headers={"Retry-After": "2"}, json={"error": {"message": "slow down", "type": "rate_limit_error", "code": None}}),
            httpx.Response(200, json={"schema_version": 3, "lease_id": "L", "samples": [{"sample_id": "a"}]}),
        ]
    )
    lease, samples = ProxyClient(URL).pull(1)
    assert lease == "L" and route.call_count == 3
    assert no_sleep == [7.0, 2.0]


@respx.mock
def test_retry_on_connection_error_with_backoff(no_sleep):
    route = respx.get(f"{URL}/admin/status").mock(
        side_effect=[httpx.ConnectError("refused"), httpx.ConnectError("refused"), httpx.Response(200, json={"version": 4})]
    )
    c = ProxyClient(URL, backoff_s=0.5)
    assert c.status()["version"] == 4
    assert route.call_count == 3 and no_sleep == [0.5, 1.0]


@respx.mock
def test_gives_up_after_max_retries(no_sleep):
    respx.post(f"{URL}/admin/pause").respond(
        503, json={"error": {"message": "engines unavailable", "type": "server_error", "code": "engine_down"}}
    )
    with pytest.raises(ProxyError, match="engines unavailable") as info:
        ProxyClient(URL, max_retries=3).pause()
    assert info.value.status == 503 and len(no_sleep) == 3

    respx.post(f"{URL}/admin/resume").mock(side_effect=httpx.ConnectError("refused"))
    with pytest.raises(ProxyError, match="cannot reach proxy"):
        ProxyClient(URL, max_retries=1).resume()


@respx.mock
def test_openai_error_becomes_exception_without_retry(no_sleep):
    route = respx.post(f"{URL}/v1/trajectories/ack").respond(
        404, json={"error": {"message": "unknown lease L9", "type": "not_found_error", "param": None, "code": "not_found"}}
    )
    with pytest.raises(ProxyError) as info:
        ProxyClient(URL).ack("L9")
    err = info.value
    assert "unknown lease L9" in str(err) and err.status == 404 and err.type == "not_found_error"
    assert route.call_count == 1 and no_sleep == []

    respx.post(f"{URL}/admin/pause").respond(401, text="nope")
    with pytest.raises(ProxyError, match="nope"):
        ProxyClient(URL).pause()


@respx.mock
def test_multi_proxy_pull_combines_and_acks_each():
    respx.post(f"{URL}/v1/trajectories/pull").respond(200, json={"schema_version": 3, "lease_id": "A", "samples": [{"sample_id": 1}]})
    p2 = respx.post(f"{URL2}/v1/trajectories/pull").respond(200, json={"schema_version": 3, "lease_id": "B", "samples": [{"sample_id": 2}, {"sample_id": 3}]})
    ack1 = respx.post(f"{URL}/v1/trajectories/ack").respond(200, json={})
    ack2 = respx.post(f"{URL2}/v1/trajectories/ack").respond(200, json={})
    respx.get(f"{URL}/admin/status").respond(200, json={"version": 3})
    respx.get(f"{URL2}/admin/status").respond(200, json={"version": 5})
    c = ProxyClient([URL, URL2])
    lease, samples = c.pull(5, 0)
    assert sorted(s["sample_id"] for s in samples) == [1, 2, 3]
    assert body(p2)["max_samples"] == 4
    c.ack(lease)
    assert body(ack1) == {"lease_id": "A"} and body(ack2) == {"lease_id": "B"}
    assert c.version() == 5


def _arrow_reply(version: str | None) -> httpx.Response:
    """An Arrow stream as pyarrow itself writes it, one sample, schema version in the metadata."""
    import pyarrow as pa

    meta = {"splice.lease_id": "L9"} | ({} if version is None else {"splice.schema_version": version})
    table = pa.table({"sample_id": ["x"], "input_ids": pa.array([[1, 2]], pa.list_(pa.int32()))}).replace_schema_metadata(meta)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return httpx.Response(200, content=sink.getvalue().to_pybytes(), headers={"content-type": "application/vnd.apache.arrow.stream"})


@pytest.mark.parametrize(
    "reply, says",
    [
        (lambda: httpx.Response(200, json={"schema_version": 0, "lease_id": "L", "samples": []}), "version 0; upgrade the proxy"),
        (lambda: httpx.Response(200, json={"lease_id": "L", "samples": [{"sample_id": "a"}]}), "without a schema_version"),
        (lambda: httpx.Response(200, json={"schema_version": 4, "lease_id": "L", "samples": []}), "version 4; upgrade the trainer"),
        (lambda: _arrow_reply("0"), "version '0'; upgrade the proxy"),
        (lambda: _arrow_reply("1"), "version '1'; upgrade the proxy"),
        (lambda: _arrow_reply("2"), "version '2'; upgrade the proxy"),
        (lambda: _arrow_reply(None), "without a schema_version"),
    ],
)
@respx.mock
def test_unknown_or_stale_schema_version_is_refused(reply, says):
    pull = respx.post(f"{URL}/v1/trajectories/pull").mock(return_value=reply())
    ack = respx.post(f"{URL}/v1/trajectories/ack").respond(200, json={})
    with pytest.raises(client_mod.SchemaVersionError) as e:
        ProxyClient(URL).pull(4)
    assert says in str(e.value) and "reads sample schema version 3 only" in str(e.value)
    assert e.value.code == "unsupported_schema_version"
    assert not ack.called  # the lease is left to time out, never acked: nothing is lost
    assert "application/vnd.apache.arrow.stream" in pull.calls[0].request.headers["accept"]


@respx.mock
def test_arrow_reply_is_read_with_its_lease():
    respx.post(f"{URL}/v1/trajectories/pull").mock(return_value=_arrow_reply("3"))
    lease, samples = ProxyClient(URL).pull(4)
    assert lease == "L9" and samples[0]["sample_id"] == "x" and samples[0]["input_ids"].tolist() == [1, 2]


@respx.mock
def test_a_cut_off_arrow_stream_is_a_proxy_error():
    whole = _arrow_reply("3").content
    respx.post(f"{URL}/v1/trajectories/pull").respond(
        200, content=whole[: len(whole) - 40], headers={"content-type": "application/vnd.apache.arrow.stream"}
    )
    with pytest.raises(ProxyError, match="not a complete stream"):
        ProxyClient(URL).pull(4)
