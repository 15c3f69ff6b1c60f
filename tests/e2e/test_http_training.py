"""Reward -> pull -> ack over HTTP against ``splice serve`` (script mode, short lease timeout).

Samples are checked against the session's own turn records: the pull API must hand out
exactly the ids and per-token arrays the proxy recorded, in token coordinates (docs/design.md 2, 5).
Every test filters pulls by its own session ids and acks what it leased, so the tests do not
depend on each other; the script has one entry (a tool call), so outputs do not depend on order.
"""

from __future__ import annotations

import time
import uuid

import httpx
import pytest

from tests.e2e.conftest import kill_tree, start_proxy, admin_headers

pytestmark = pytest.mark.slow

ENTRY = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>'
TOOLS = [
    {
        "type": "function",
        "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}},
    }
]
LEASE_S = 2.0


@pytest.fixture(scope="module")
def proxy(tmp_path_factory, model_dir):
    p = start_proxy(tmp_path_factory.mktemp("training"), model_dir, script=[ENTRY], extra=["--lease-timeout-s", str(LEASE_S)])
    yield p
    kill_tree(p)


def _chat(proxy, sid: str, messages: list[dict], headers: dict | None = None) -> dict:
    r = httpx.post(
        proxy.url + "/v1/chat/completions",
        json={"model": "splice-model", "messages": messages, "tools": TOOLS},
        headers={"X-Session-Id": sid, **(headers or {})},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()


def _two_turn_session(proxy, headers: dict | None = None) -> str:
    """A session with a first turn and a spliced second turn (tool result bridge)."""
    sid = "tr-" + uuid.uuid4().hex[:10]
    msgs = [{"role": "user", "content": "Add 1 and 2, then again."}]
    c1 = _chat(proxy, sid, msgs, headers)
    m = c1["choices"][0]["message"]
    (tc,) = m["tool_calls"]
    msgs += [{"role": "assistant", "content": m.get("content"), "tool_calls": m["tool_calls"]}, {"role": "tool", "tool_call_id": tc["id"], "content": "3"}]
    _chat(proxy, sid, msgs, headers)
    return sid


def _reward(proxy, sid: str, value: float) -> httpx.Response:
    return httpx.post(f"{proxy.url}/v1/sessions/{sid}/reward", json={"reward": value}, headers=admin_headers(), timeout=30)


def _pull(proxy, max_samples: int = 1000, wait_s: float = 0.0) -> dict:
    r = httpx.post(proxy.url + "/v1/trajectories/pull", json={"max_samples": max_samples, "wait_s": wait_s}, headers=admin_headers(), timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _ack(proxy, lease_id: str) -> httpx.Response:
    return httpx.post(proxy.url + "/v1/trajectories/ack", json={"lease_id": lease_id}, headers=admin_headers(), timeout=30)


def _mine(pulled: dict, sids) -> list[dict]:
    return [s for s in pulled["samples"] if s["session_id"] in set(sids)]


def _session(proxy, sid: str) -> dict:
    r = proxy.get(f"/v1/sessions/{sid}")
    assert r.status_code == 200, r.text
    return r.json()


def test_sample_arrays_equal_session_records_then_ack(proxy):
    sid = _two_turn_session(proxy)
    s = _session(proxy, sid)
    t1, t2 = s["turns"]
    assert t2["spliced"]
    assert _reward(proxy, sid, 0.75).status_code == 200

    pulled = _pull(proxy)
    (sample,) = _mine(pulled, [sid])
    assert pulled["lease_id"]
    assert sample["reward"] == 0.75 and sample["session_id"] == sid
    assert sample["turn_ids"] == [t1["turn_id"], t2["turn_id"]]

    p1, o1, p2, o2 = t1["prompt_ids"], t1["output_ids"], t2["prompt_ids"], t2["output_ids"]
    bridge = p2[len(p1) + len(o1):]
    assert p2[: len(p1) + len(o1)] == p1 + o1 and bridge
    L = len(p1) + len(o1) + len(bridge) + len(o2)
    assert sample["input_ids"] == p1 + o1 + bridge + o2
    for k in ("input_ids", "loss_mask", "logprobs", "versions", "proximal_logprobs_t", "proximal_versions"):
        assert len(sample[k]) == L, k

    def layout(ctx_fill, out1, out2):
        return [ctx_fill] * len(p1) + list(out1) + [ctx_fill] * len(bridge) + list(out2)

    assert sample["loss_mask"] == layout(0, [1] * len(o1), [1] * len(o2))
    assert sample["logprobs"] == pytest.approx(layout(0.0, t1["output_logprobs"], t2["output_logprobs"]), abs=0)
    assert sample["versions"] == layout(-1, t1["versions"], t2["versions"])
    assert sample["proximal_logprobs_t"] == pytest.approx(layout(0.0, t1["proximal_logprobs_t"], t2["proximal_logprobs_t"]), abs=0)
    assert sample["proximal_versions"] == layout(-1, t1["proximal_versions"], t2["proximal_versions"])
    # real logprobs: all <= 0 and not all equal (a shift by one position would show)
    out_lp = t1["output_logprobs"] + t2["output_logprobs"]
    assert all(x <= 0.0 for x in out_lp) and len(set(out_lp)) > 1
    assert set(t1["versions"] + t2["versions"]) == {0}

    ack = _ack(proxy, pulled["lease_id"])
    assert ack.status_code == 200 and ack.json()["acked"] is True
    assert _ack(proxy, pulled["lease_id"]).status_code == 200  # a retried ack is harmless
    assert _mine(_pull(proxy), [sid]) == []
    assert _session(proxy, sid)["acked"] is True


def test_unacked_lease_returns_after_timeout(proxy):
    sid = _two_turn_session(proxy)
    assert _reward(proxy, sid, 1.0).status_code == 200
    first = _pull(proxy)
    (a,) = _mine(first, [sid])
    # leased: not handed out again while the lease lives
    assert _mine(_pull(proxy), [sid]) == []
    assert _session(proxy, sid)["leased"] is True
    time.sleep(LEASE_S + 0.3)
    second = _pull(proxy)
    (b,) = _mine(second, [sid])
    assert second["lease_id"] != first["lease_id"]
    assert b == a  # the same sample, intact
    late = _ack(proxy, first["lease_id"])
    assert late.status_code == 409 and late.json()["error"]["code"] == "lease_expired"
    assert _ack(proxy, second["lease_id"]).status_code == 200
    assert _mine(_pull(proxy), [sid]) == []


def test_group_handed_out_whole_once_complete(proxy):
    gid = "grp-" + uuid.uuid4().hex[:8]
    hdr = {"X-Group-Id": gid, "X-Group-Size": "2"}
    s1 = _two_turn_session(proxy, hdr)
    s2 = _two_turn_session(proxy, hdr)
    sess = _session(proxy, s1)
    assert sess["group_id"] == gid and sess["group_size"] == 2
    assert _reward(proxy, s1, 1.0).status_code == 200
    pulled = _pull(proxy)
    assert _mine(pulled, [s1, s2]) == []  # one of two rewards: not ready
    if pulled["lease_id"]:
        _ack(proxy, pulled["lease_id"])
    assert _reward(proxy, s2, 0.0).status_code == 200
    pulled = _pull(proxy, max_samples=1)  # a whole group even when it exceeds max_samples
    got = _mine(pulled, [s1, s2])
    assert sorted(x["session_id"] for x in got) == sorted([s1, s2])
    assert len(pulled["samples"]) == 2
    assert {x["group_id"] for x in got} == {gid}
    assert {x["session_id"]: x["reward"] for x in got} == {s1: 1.0, s2: 0.0}
    assert _ack(proxy, pulled["lease_id"]).status_code == 200
    assert _mine(_pull(proxy), [s1, s2]) == []


def test_reward_conflicts_and_unknown_ids(proxy):
    sid = _two_turn_session(proxy)
    assert _reward(proxy, sid, 0.5).status_code == 200
    again = _reward(proxy, sid, 0.25)
    assert again.status_code == 409
    assert again.json()["error"]["type"] and again.json()["error"]["code"]
    assert _session(proxy, sid)["reward"] == 0.5  # the first reward stands
    # a closed session takes no more turns
    r = httpx.post(
        proxy.url + "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "more"}]},
        headers={"X-Session-Id": sid},
        timeout=60,
    )
    assert r.status_code == 409, r.text

    missing = _reward(proxy, "no-such-session", 1.0)
    assert missing.status_code == 404 and missing.json()["error"]["code"]
    assert proxy.get("/v1/sessions/no-such-session").status_code == 404
    bad = _ack(proxy, "lease_does_not_exist")
    assert bad.status_code == 404
    assert httpx.post(f"{proxy.url}/v1/sessions/{sid}/reward", json={"reward": "high"}, headers=admin_headers(), timeout=30).status_code == 400
    # clean up: hand the sample out and ack it
    pulled = _pull(proxy)
    assert len(_mine(pulled, [sid])) == 1
    assert _ack(proxy, pulled["lease_id"]).status_code == 200


def test_non_finite_reward_is_400_and_changes_nothing(proxy):
    sid = _two_turn_session(proxy)
    for raw in (b'{"reward": NaN}', b'{"reward": Infinity}', b'{"reward": -Infinity}', b'{"reward": 1e999}'):
        r = httpx.post(f"{proxy.url}/v1/sessions/{sid}/reward", content=raw,
                       headers={"Content-Type": "application/json", **admin_headers()}, timeout=30)
        assert r.status_code == 400, (raw, r.status_code, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    s = _session(proxy, sid)
    assert s["reward"] is None and s["closed"] is False
    assert _reward(proxy, sid, -0.5).status_code == 200
    pulled = _pull(proxy)
    (x,) = _mine(pulled, [sid])
    assert x["reward"] == -0.5
    assert _ack(proxy, pulled["lease_id"]).status_code == 200


def test_pull_waits_for_a_reward(proxy):
    sid = _two_turn_session(proxy)
    import threading

    t = threading.Timer(0.5, lambda: _reward(proxy, sid, 2.0))
    t.start()
    t0 = time.monotonic()
    pulled = _pull(proxy, wait_s=10)
    t.join()
    assert time.monotonic() - t0 < 8
    assert [x["session_id"] for x in pulled["samples"]] == [sid]
    assert _ack(proxy, pulled["lease_id"]).status_code == 200


def test_arrow_pull_matches_json_and_the_schema_on_real_turns(proxy):
    """A real two-turn session: the Arrow answer (read by pyarrow) and the JSON answer carry
    the same values, both validate against proxy/schemas/sample.schema.json, and the per-turn
    spans and sampling are the ones the session recorded."""
    import json as _json
    from pathlib import Path

    import numpy as np
    import pyarrow as pa
    from jsonschema import Draft202012Validator

    schema = _json.loads((Path(__file__).parents[2] / "proxy" / "schemas" / "sample.schema.json").read_text())
    sid = _two_turn_session(proxy)
    t1, t2 = _session(proxy, sid)["turns"]
    assert _reward(proxy, sid, 0.5).status_code == 200
    r = httpx.post(proxy.url + "/v1/trajectories/pull", json={"max_samples": 1000},
                   headers={"Accept": "application/vnd.apache.arrow.stream", **admin_headers()}, timeout=60)  # fmt: skip
    assert r.status_code == 200 and r.headers["content-type"] == "application/vnd.apache.arrow.stream"
    reader = pa.ipc.open_stream(r.content)
    meta = {k.decode(): v.decode() for k, v in reader.schema.metadata.items()}
    rows = reader.read_all().to_pylist()
    Draft202012Validator(schema).validate(
        {"schema_version": int(meta["splice.schema_version"]), "lease_id": meta["splice.lease_id"], "samples": rows,
         "dropped_stale": int(meta["splice.dropped_stale"])}
    )  # fmt: skip
    (a,) = [s for s in rows if s["session_id"] == sid]
    spans = [(t["turn_id"], t["start"], t["length"], t["finish_reason"]) for t in a["turns"]]
    assert spans == [(t["turn_id"], len(t["prompt_ids"]), len(t["output_ids"]), t["finish_reason"]) for t in (t1, t2)]
    assert a["turns"][1]["context_start"] == len(t1["prompt_ids"]) + len(t1["output_ids"])
    assert all(t["temperature"] == 1.0 and t["top_p"] == 1.0 and t["top_k"] == -1 for t in a["turns"])
    assert all(t["model"] and t["engine_id"].startswith("http://127.0.0.1:") for t in a["turns"])
    assert a["rewarded_at"] and a["turns"][0]["created_at"] <= a["rewarded_at"]

    time.sleep(LEASE_S + 0.3)  # unacked: the same samples come back, now as JSON
    pulled = _pull(proxy)
    Draft202012Validator(schema).validate(pulled)
    (j,) = _mine(pulled, [sid])
    assert set(j) == set(a)
    for key in j:
        if key in ("logprobs", "proximal_logprobs_t"):
            assert np.array_equal(np.asarray(j[key], np.float32), np.asarray(a[key], np.float32))
        else:
            assert j[key] == a[key], key
    assert _ack(proxy, pulled["lease_id"]).status_code == 200
