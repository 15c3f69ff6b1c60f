"""R2 per session leaf against the reference engine (a real transformers model over HTTP).

Two sessions of two turns are sampled by version 0; the weights move to version 1 (a perturbed
copy). Session "goes-on" sends its next turn: that turn's own engine call must bring every
owed value, with no prefill. Session "idle" sends nothing: the next pause must settle it with one
prefill of its last turn. The expected values come from an independent forward pass with
transformers under the version-1 weights: ``log_softmax(logits[i-1])[token i]``.
"""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.conftest import kill_tree, start_proxy, admin_headers

pytestmark = pytest.mark.slow

SCRIPT = [f"Answer {k}: the value is {k * 7}.<|im_end|>" for k in range(1, 9)]


@pytest.fixture(scope="module")
def v1(tmp_path_factory, model_dir):
    from engines.reference.model_init import perturb_model

    return str(perturb_model(model_dir, tmp_path_factory.mktemp("r2w") / "v1", seed=5, scale=0.05))


@pytest.fixture(scope="module")
def proxy(tmp_path_factory, model_dir):
    p = start_proxy(tmp_path_factory.mktemp("r2proxy"), model_dir, script=SCRIPT)
    yield p
    kill_tree(p)


def _forward(model_path: str, ids: list[int]) -> list[float]:
    """log pi(ids[i] | ids[:i]) for every i >= 1 (index i - 1), from plain transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]


def _post(proxy, path: str, body: dict, sid: str | None = None) -> dict:
    headers = {"X-Session-Id": sid} if sid else admin_headers()  # agent turns carry the session; /admin the token
    r = httpx.post(proxy.url + path, json=body, headers=headers, timeout=120)
    assert r.status_code == 200, (path, r.text)
    return r.json()


def _metric(proxy, name: str) -> float:
    for line in httpx.get(proxy.url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "_total "):
            return float(line.split()[-1])
    raise AssertionError(name)


def _session(proxy, sid: str, turns: int) -> list[dict]:
    msgs = [{"role": "user", "content": f"Question for {sid}?"}]
    for k in range(turns):
        out = _post(proxy, "/v1/chat/completions", {"model": "m", "messages": msgs, "max_tokens": 64}, sid)
        msgs += [{"role": "assistant", "content": out["choices"][0]["message"]["content"]}, {"role": "user", "content": f"And {k}?"}]
    return msgs


def _check(proxy, sid: str, v1_path: str) -> int:
    turns = httpx.get(f"{proxy.url}/v1/sessions/{sid}", headers=admin_headers(), timeout=30).json()["turns"]
    last = turns[-1]["prompt_ids"] + turns[-1]["output_ids"]
    ref = _forward(v1_path, last)
    n = 0
    for t in turns:
        if 0 not in t["versions"]:
            continue
        assert last[: len(t["prompt_ids"]) + len(t["output_ids"])] == t["prompt_ids"] + t["output_ids"]  # one path
        assert t["proximal_versions"] == [1] * len(t["output_ids"])
        start = len(t["prompt_ids"])
        want = ref[start - 1 : start - 1 + len(t["output_ids"])]
        assert t["proximal_logprobs_t"] == pytest.approx(want, abs=1e-4)
        assert max(abs(a - b) for a, b in zip(t["proximal_logprobs_t"], t["output_logprobs"])) > 1e-3
        n += len(t["output_ids"])
    return n


def test_next_turn_brings_its_values_and_an_idle_session_costs_one_prefill(proxy, v1):
    goes_on = _session(proxy, "goes-on", 2)
    _session(proxy, "idle", 2)
    _post(proxy, "/admin/pause", {})
    _post(proxy, "/admin/update_weights", {"model_path": v1, "version": 1})
    _post(proxy, "/admin/resume", {})
    prefills0 = _metric(proxy, "splice_recompute_prefills")
    _post(proxy, "/v1/chat/completions", {"model": "m", "messages": goes_on, "max_tokens": 64}, "goes-on")
    paused = _post(proxy, "/admin/pause", {})  # the deadline: settles "idle" (and waits for stored values)
    assert paused["recompute"]["prefills"] == 1 and paused["recompute"]["missing_tokens"] == 0
    assert _metric(proxy, "splice_recompute_prefills") - prefills0 == 1
    n_goes_on = _check(proxy, "goes-on", v1)  # turns 0 and 1, from turn 2's own engine call
    assert n_goes_on > 0 and _metric(proxy, "splice_piggybacked_tokens") == n_goes_on
    assert _check(proxy, "idle", v1) > 0  # from one prefill of its last turn
    _post(proxy, "/admin/resume", {})
