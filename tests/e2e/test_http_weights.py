"""Weight updates through the admin API while a generation is in flight (docs/design.md 4, R1 and R2).

The engine emits a long scripted text at a fixed pace; the test pauses the engines mid-output,
loads a perturbed copy of the model as version 1 and resumes. The proxy must stamp the tokens
before the abort with version 0 and the rest with version 1, and give the version-0 tokens
their proximal logprob under the NEW weights from the resume prefill. The expected values come
from an independent forward pass with transformers: ``log_softmax(logits[i-1])[token i]``.
A second update (version 2) with nothing in flight followed by a pull must give the version-1
tokens their values under version 2 (R2) before they are handed out.
"""

from __future__ import annotations

import threading
import time
import uuid

import httpx
import pytest

from tests.e2e.conftest import kill_tree, start_proxy, admin_headers

pytestmark = pytest.mark.slow

LONG = (
    "The quick brown fox jumps over the lazy dog while the patient cat watches from the warm windowsill, "
    "counting birds that fly past the old oak tree in the garden behind the house; meanwhile the farmer "
    "walks to the barn, opens the heavy wooden door, feeds the horses and the goats, and then sits down "
    "on a bench to read the morning newspaper before the long day of work in the fields begins again."
)
DELAY_MS = 40


@pytest.fixture(scope="module")
def weights(tmp_path_factory, model_dir):
    from engines.reference.model_init import perturb_model

    root = tmp_path_factory.mktemp("weights")
    v1 = perturb_model(model_dir, root / "v1", seed=11, scale=0.05)
    v2 = perturb_model(model_dir, root / "v2", seed=22, scale=0.05)
    return str(v1), str(v2)


@pytest.fixture(scope="module")
def proxy(tmp_path_factory, model_dir):
    p = start_proxy(tmp_path_factory.mktemp("wproxy"), model_dir, script=[LONG + "<|im_end|>"], delay_ms=DELAY_MS)
    yield p
    kill_tree(p)


def _token_logprobs(model_path: str, ids: list[int], start: int) -> list[float]:
    """log pi(ids[i] | ids[:i]) for i >= start, from a plain transformers forward pass."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [float(lp[i - 1, ids[i]]) for i in range(start, len(ids))]


def _admin(proxy, path: str, body: dict | None = None) -> dict:
    r = httpx.post(proxy.url + path, json=body or {}, headers=admin_headers(), timeout=120)
    assert r.status_code == 200, (path, r.text)
    return r.json()


def test_update_during_generation_then_second_update_before_pull(proxy, weights):
    v1_path, v2_path = weights
    sid = "w-" + uuid.uuid4().hex[:10]
    seen: list[str] = []
    got_tokens = threading.Event()
    result: dict = {}

    def agent():
        try:
            with httpx.stream(
                "POST",
                proxy.url + "/v1/chat/completions",
                json={"model": "splice-model", "messages": [{"role": "user", "content": "Tell me a story."}], "stream": True},
                headers={"X-Session-Id": sid},
                timeout=120,
            ) as r:
                result["status"] = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: ") and '"content"' in line:
                        seen.append(line)
                        if len(seen) >= 12:
                            got_tokens.set()
                    if line == "data: [DONE]":
                        result["done"] = True
        except Exception as exc:  # reported by the main thread
            result["error"] = exc
        finally:
            got_tokens.set()

    th = threading.Thread(target=agent)
    th.start()
    assert got_tokens.wait(60)
    assert "error" not in result, result
    paused = _admin(proxy, "/admin/pause")
    assert paused["paused"] is True
    status = proxy.get("/admin/status").json()
    assert status["paused"] is True
    assert status["inflight"] == 1  # the aborted request is held by the proxy, not failed
    assert _admin(proxy, "/admin/update_weights", {"model_path": v1_path, "version": 1})["version"] == 1
    time.sleep(0.3)  # the held request must not move while paused
    n_paused = len(seen)
    time.sleep(0.3)
    assert len(seen) == n_paused
    _admin(proxy, "/admin/resume")
    th.join(120)
    assert not th.is_alive()
    assert result.get("status") == 200 and result.get("done"), result

    s = proxy.get(f"/v1/sessions/{sid}").json()
    (t,) = s["turns"]
    assert t["finish_reason"] == "stop"
    prompt, out = t["prompt_ids"], t["output_ids"]
    versions = t["versions"]
    k = versions.index(1)  # first token sampled after the update
    assert 0 < k < len(out) - 5, versions
    assert versions == [0] * k + [1] * (len(out) - k)

    # v0 tokens: proximal = log pi_v1 from the resume prefill; v1 tokens: proximal = behaviour
    ref_v1 = _token_logprobs(v1_path, prompt + out, len(prompt))
    behav, prox, pvers = t["output_logprobs"], t["proximal_logprobs_t"], t["proximal_versions"]
    assert pvers == [1] * len(out)
    assert prox[:k] == pytest.approx(ref_v1[:k], abs=1e-4)
    assert max(abs(a - b) for a, b in zip(prox[:k], behav[:k])) > 1e-3  # the weights really changed
    assert prox[k:] == behav[k:]
    # the v1 tokens were sampled by the new weights: their behaviour logprobs are v1's
    assert behav[k:] == pytest.approx(ref_v1[k:], abs=1e-3)
    ref_v0 = _token_logprobs(str(_base_model(proxy)), prompt + out, len(prompt))
    assert behav[:k] == pytest.approx(ref_v0[:k], abs=1e-3)

    # second update with nothing in flight, then reward + pull: v1 tokens get log pi_v2 (R2)
    assert _admin(proxy, "/admin/update_weights", {"model_path": v2_path, "version": 2})["version"] == 2
    assert httpx.post(f"{proxy.url}/v1/sessions/{sid}/reward", json={"reward": 1.0}, headers=admin_headers(), timeout=30).status_code == 200
    pulled = _admin(proxy, "/v1/trajectories/pull", {"max_samples": 10})
    (sample,) = [x for x in pulled["samples"] if x["session_id"] == sid]
    ref_v2 = _token_logprobs(v2_path, prompt + out, len(prompt))
    n = len(prompt)
    assert sample["input_ids"] == prompt + out
    assert sample["versions"] == [-1] * n + versions
    assert sample["proximal_versions"] == [-1] * n + [1] * k + [2] * (len(out) - k)
    sp = sample["proximal_logprobs_t"][n:]
    assert sp[:k] == pytest.approx(prox[:k], abs=1e-6)  # v0 tokens keep their v1 values
    assert sp[k:] == pytest.approx(ref_v2[k:], abs=1e-4)
    assert max(abs(a - b) for a, b in zip(sp[k:], behav[k:])) > 1e-3
    assert sample["logprobs"][n:] == pytest.approx(behav, abs=0)
    # the session view shows the recomputed values too
    t2 = proxy.get(f"/v1/sessions/{sid}").json()["turns"][0]
    assert t2["proximal_versions"] == [1] * k + [2] * (len(out) - k)
    assert _admin(proxy, "/v1/trajectories/ack", {"lease_id": pulled["lease_id"]})["acked"] is True
    status = proxy.get("/admin/status").json()
    assert status["version"] == 2 and status["paused"] is False


def _base_model(proxy) -> str:
    i = proxy.args.index("--reference-model")
    return proxy.args[i + 1]


def test_two_updates_during_one_streamed_response(proxy, weights, tmp_path_factory, model_dir):
    """Three segments (seed 001's worked example over HTTP): each token gets its own value.

    A Responses stream runs across two pause/update/resume cycles; its text deltas must add up to
    the scripted text exactly (nothing lost or repeated at a segment boundary). A request that
    arrives while the engines are paused waits and is sampled entirely by the new weights.
    """
    from engines.reference.model_init import perturb_model

    root = tmp_path_factory.mktemp("weights3")
    v3 = str(perturb_model(model_dir, root / "v3", seed=33, scale=0.05))
    v4 = str(perturb_model(model_dir, root / "v4", seed=44, scale=0.05))
    base = int(proxy.get("/admin/status").json()["version"])  # 2 after the test above; 0 if run alone
    sid = "w3-" + uuid.uuid4().hex[:10]
    deltas: list[str] = []
    result: dict = {}
    progress = threading.Condition()

    def agent():
        try:
            with httpx.stream(
                "POST", proxy.url + "/v1/responses",
                json={"model": "splice-model", "input": "Tell me a story.", "stream": True},
                headers={"X-Session-Id": sid}, timeout=120,
            ) as r:
                result["status"] = r.status_code
                import json as _json

                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    ev = _json.loads(line[6:])
                    if ev["type"] == "response.output_text.delta":
                        with progress:
                            deltas.append(ev["delta"])
                            progress.notify_all()
                    elif ev["type"] in ("response.completed", "response.incomplete", "response.failed"):
                        result["final"] = ev
        except Exception as exc:
            result["error"] = exc
        finally:
            with progress:
                result["ended"] = True
                progress.notify_all()

    def wait_for(n: int) -> None:
        with progress:
            assert progress.wait_for(lambda: len(deltas) >= n or result.get("ended"), timeout=60)
        assert not result.get("ended"), result

    th = threading.Thread(target=agent)
    th.start()
    late: dict = {}
    wait_for(8)
    _admin(proxy, "/admin/pause")

    def late_agent():  # arrives while paused
        late["r"] = httpx.post(
            proxy.url + "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "late"}], "max_tokens": 6},
            headers={"X-Session-Id": sid + "-late"}, timeout=120,
        )

    th_late = threading.Thread(target=late_agent)
    th_late.start()
    time.sleep(0.3)
    _admin(proxy, "/admin/update_weights", {"model_path": v3, "version": base + 1})
    _admin(proxy, "/admin/resume")
    n1 = len(deltas)
    wait_for(n1 + 8)
    _admin(proxy, "/admin/pause")
    _admin(proxy, "/admin/update_weights", {"model_path": v4, "version": base + 2})
    _admin(proxy, "/admin/resume")
    th.join(120)
    th_late.join(120)
    assert result.get("status") == 200 and "error" not in result, result
    final = result["final"]["response"]
    assert final["status"] == "completed"
    assert "".join(deltas) == LONG
    assert final["output"][0]["content"][0]["text"] == LONG

    (t,) = proxy.get(f"/v1/sessions/{sid}").json()["turns"]
    prompt, out, vers = t["prompt_ids"], t["output_ids"], t["versions"]
    a, b = vers.count(base), vers.count(base + 1)
    c = len(out) - a - b
    assert a > 0 and b > 0 and c > 0, vers
    assert vers == [base] * a + [base + 1] * b + [base + 2] * c
    behav, prox, pv = t["output_logprobs"], t["proximal_logprobs_t"], t["proximal_versions"]
    ref_1 = _token_logprobs(v3, prompt + out, len(prompt))
    ref_2 = _token_logprobs(v4, prompt + out, len(prompt))
    assert pv == [base + 1] * a + [base + 2] * (b + c)
    assert prox[:a] == pytest.approx(ref_1[:a], abs=1e-4)  # from the first resume prefill
    assert prox[a : a + b] == pytest.approx(ref_2[a : a + b], abs=1e-4)  # from the second
    assert prox[a + b :] == behav[a + b :]
    assert behav[a : a + b] == pytest.approx(ref_1[a : a + b], abs=1e-3)
    assert behav[a + b :] == pytest.approx(ref_2[a + b :], abs=1e-3)

    assert late["r"].status_code == 200, late["r"].text
    (lt,) = proxy.get(f"/v1/sessions/{sid}-late").json()["turns"]
    assert set(lt["versions"]) == {base + 1}, lt["versions"]  # sampled after the first update only
    assert lt["proximal_versions"] == [base + 2] * len(lt["versions"]) or lt["proximal_versions"] == lt["versions"]


def test_reward_while_a_turn_is_generating(proxy):
    """The reward closes the session: the turn still generating is refused with 409 (not a 500),
    and the stored session and its sample are exactly what was committed before the reward."""
    sid = "wr-" + uuid.uuid4().hex[:10]
    first = httpx.post(
        proxy.url + "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "one"}], "max_tokens": 3},
        headers={"X-Session-Id": sid}, timeout=60,
    )
    assert first.status_code == 200, first.text
    msgs = [{"role": "user", "content": "one"}, {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]}, {"role": "user", "content": "two"}]
    out: dict = {}
    th = threading.Thread(target=lambda: out.setdefault("r", httpx.post(
        proxy.url + "/v1/chat/completions", json={"model": "m", "messages": msgs}, headers={"X-Session-Id": sid}, timeout=60)))
    th.start()
    deadline = time.monotonic() + 30
    while proxy.get("/admin/status").json()["inflight"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    assert httpx.post(f"{proxy.url}/v1/sessions/{sid}/reward", json={"reward": 1.0}, headers=admin_headers(), timeout=30).status_code == 200
    th.join(60)
    r = out["r"]
    assert r.status_code == 409, r.text
    assert r.json()["error"]["code"] == "session_closed"
    s = proxy.get(f"/v1/sessions/{sid}").json()
    assert len(s["turns"]) == 1 and s["closed"] and s["reward"] == 1.0
    pulled = _admin(proxy, "/v1/trajectories/pull", {"max_samples": 10})
    mine = [x for x in pulled["samples"] if x["session_id"] == sid]
    assert len(mine) == 1 and mine[0]["turn_ids"] == [s["turns"][0]["turn_id"]]
    _admin(proxy, "/v1/trajectories/ack", {"lease_id": pulled["lease_id"]})
    assert proxy.get("/health").json()["status"] == "ok"
