"""``kill -9`` of the proxy and its engine between turns, then a restart on the same store (docs/design.md 11).

Every turn whose response was returned, every reward and every lease must survive; a pull
after the restart must not hand out a sample that is leased (and not expired); acking that
lease must work; and a session continued after the restart must still be spliced, its state
recovered from the store alone (the new process has no memory of the old one).
"""

from __future__ import annotations

import uuid

import httpx
import pytest

from tests.e2e.conftest import kill_tree, start_proxy, admin_headers

pytestmark = pytest.mark.slow

ENTRY = '<tool_call>\n{"name": "add", "arguments": {"a": 4, "b": 5}}\n</tool_call><|im_end|>'
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}},
    }
]
RESP_TOOLS = [{"type": "function", "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}]


def _chat(url: str, sid: str, messages: list[dict]) -> dict:
    r = httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": messages, "tools": CHAT_TOOLS}, headers={"X-Session-Id": sid}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _continue(messages: list[dict], reply: dict) -> list[dict]:
    m = reply["choices"][0]["message"]
    (tc,) = m["tool_calls"]
    return messages + [{"role": "assistant", "content": m.get("content"), "tool_calls": m["tool_calls"]}, {"role": "tool", "tool_call_id": tc["id"], "content": "9"}]


def _responses(url: str, body: dict) -> dict:
    r = httpx.post(url + "/v1/responses", json={"model": "m", "tools": RESP_TOOLS, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _spliced_onto(prev: dict, cur: dict) -> bool:
    full = prev["prompt_ids"] + prev["output_ids"]
    return cur["spliced"] and cur["prompt_ids"][: len(full)] == full and len(cur["prompt_ids"]) > len(full)


def test_kill9_and_restart_keeps_turns_rewards_leases(tmp_path, model_dir):
    store = str(tmp_path / "store" / "splice.sqlite")
    p = start_proxy(tmp_path, model_dir, script=[ENTRY], store=store)
    try:
        url = p.url
        # session X: two chat turns, the second spliced
        x = "rs-x-" + uuid.uuid4().hex[:8]
        msgs = [{"role": "user", "content": "Add 4 and 5 twice."}]
        r1 = _chat(url, x, msgs)
        msgs = _continue(msgs, r1)
        r2 = _chat(url, x, msgs)
        msgs = _continue(msgs, r2)
        # session Z: no session header at all; found again from its message history
        zmsgs = [{"role": "user", "content": "Add 4 and 5, no header."}]
        rz = httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": zmsgs, "tools": CHAT_TOOLS}, timeout=60)
        assert rz.status_code == 200, rz.text
        zmsgs = _continue(zmsgs, rz.json())
        # session Y: a Responses turn, continued later by previous_response_id
        y1 = _responses(url, {"input": "Add 4 and 5."})
        y = y1["splice"]["session_id"]
        # session R: rewarded and leased; session Q: rewarded, not yet pulled
        rsid, qsid = "rs-r-" + uuid.uuid4().hex[:8], "rs-q-" + uuid.uuid4().hex[:8]
        _chat(url, rsid, [{"role": "user", "content": "r"}])
        _chat(url, qsid, [{"role": "user", "content": "q"}])
        assert httpx.post(f"{url}/v1/sessions/{rsid}/reward", json={"reward": 0.5}, headers=admin_headers(), timeout=30).status_code == 200
        lease = httpx.post(url + "/v1/trajectories/pull", json={"max_samples": 100}, headers=admin_headers(), timeout=60).json()
        assert [s["session_id"] for s in lease["samples"]] == [rsid]
        assert httpx.post(f"{url}/v1/sessions/{qsid}/reward", json={"reward": -1.0}, headers=admin_headers(), timeout=30).status_code == 200
        before = {sid: httpx.get(f"{url}/v1/sessions/{sid}", headers=admin_headers(), timeout=30).json() for sid in (x, y, rsid, qsid)}
        assert len(before[x]["turns"]) == 2 and _spliced_onto(*before[x]["turns"])
    finally:
        kill_tree(p)  # kill -9 proxy and engine, no chance to flush anything
    assert p.proc.returncode == -9

    p2 = start_proxy(tmp_path, model_dir, script=[ENTRY], store=store)
    try:
        url = p2.url
        for sid, old in before.items():
            new = httpx.get(f"{url}/v1/sessions/{sid}", headers=admin_headers(), timeout=30).json()
            assert new["turns"] == old["turns"], sid
            assert new["reward"] == old["reward"] and new["closed"] == old["closed"], sid
        assert before[rsid]["leased"] is True
        # stored responses survive too
        got = httpx.get(f"{url}/v1/responses/{y1['id']}", timeout=30)
        assert got.status_code == 200 and got.json()["output"] == y1["output"]

        # the leased sample is not handed out again; the unleased one is
        pulled = httpx.post(url + "/v1/trajectories/pull", json={"max_samples": 100}, headers=admin_headers(), timeout=60).json()
        assert [s["session_id"] for s in pulled["samples"]] == [qsid]
        assert pulled["samples"][0]["reward"] == -1.0
        ack = httpx.post(url + "/v1/trajectories/ack", json={"lease_id": lease["lease_id"]}, headers=admin_headers(), timeout=30)
        assert ack.status_code == 200, ack.text
        assert httpx.post(url + "/v1/trajectories/ack", json={"lease_id": pulled["lease_id"]}, headers=admin_headers(), timeout=30).status_code == 200
        again = httpx.post(url + "/v1/trajectories/pull", json={"max_samples": 100}, headers=admin_headers(), timeout=60).json()
        assert again["samples"] == []
        assert httpx.post(f"{url}/v1/sessions/{rsid}/reward", json={"reward": 1.0}, headers=admin_headers(), timeout=30).status_code == 409

        # continuing turns after the restart are spliced from the stored ids
        _chat(url, x, msgs)
        tx = httpx.get(f"{url}/v1/sessions/{x}", headers=admin_headers(), timeout=30).json()["turns"]
        assert len(tx) == 3 and _spliced_onto(tx[1], tx[2]), tx[2]["fork_reason"]
        (call,) = [it for it in y1["output"] if it["type"] == "function_call"]
        y2 = _responses(url, {"previous_response_id": y1["id"], "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": "9"}]})
        assert y2["splice"]["session_id"] == y and y2["splice"]["spliced"] is True
        ty = httpx.get(f"{url}/v1/sessions/{y}", headers=admin_headers(), timeout=30).json()["turns"]
        assert len(ty) == 2 and _spliced_onto(ty[0], ty[1])
        rz2 = httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": zmsgs, "tools": CHAT_TOOLS}, timeout=60)
        assert rz2.status_code == 200, rz2.text
        tz = httpx.get(f"{url}/v1/sessions/{rz2.json()['splice']['session_id']}", headers=admin_headers(), timeout=30).json()["turns"]
        assert len(tz) == 2 and _spliced_onto(tz[0], tz[1]), tz[-1]["fork_reason"]
    finally:
        kill_tree(p2)
