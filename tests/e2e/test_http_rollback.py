"""Seed 002's rollback trajectory driven through the Chat Completions API (docs/design.md 5).

Seed 002 (4 steps, prompt [1,2]):

    step 0: prompt [1,2]          -> [3,4]          sample A
    step 1: prompt [1,2,3,4,5]    -> [6]            extends A: A = [1..6]
    step 2: prompt [1,2]          -> [3,4,5,6,7]    rollback; prompt shorter than A -> new sample B
    step 3: prompt [1..8]         -> [9]            matches A AND B; must extend B (longest)

Through a chat template that exact shape cannot happen: step 2's output would have to
re-generate step 1's prompt tokens (the bridge), and every bridge of the Qwen3 template
contains ``<|im_end|>``, a stop token at which any engine ends the output. The closest honest
equivalent keeps the property the seed is about -- after a rollback, sample A's tokens are a
strict prefix of sample B's, so the next turn's prompt matches both -- and it is built like this:

    turn 1: [user]                           -> O1 (a tool call)               sample A
    turn 2: [user, O1, tool]   (spliced)     -> O2 (cut by max_tokens: no stop token)
                                                A = p1 + O1 + bridge2 + O2
    turn 3: [user, O1, tool]   (same history; the agent rolls back turn 2 and re-asks)
                               prompt p3 == p2, shorter than A -> new sample B
                                             -> O3 = O2 + more text + <|im_end|>
                                                B = p2 + O3, so A is a strict prefix of B
    turn 4: [user, O1, tool, O3, user]       -> O4
                               prompt p4 = p2 + O3 + bridge4 matches A and B: extends B

Expected (token coordinates): A = p1 | O1 | bridge2 | O2 with mask 0|1|0|1 and
B = p2 | O3 | bridge4 | O4 with mask 0|1|0|1 (O1 is context in B: B's own turn did not sample
it). The first-match rule would instead append O3's tail and bridge4 to A with mask 0, filing
sampled tokens as prompt, and B would never see turn 4.
"""

from __future__ import annotations

import uuid

import httpx
import pytest

from tests.e2e.conftest import kill_tree, start_proxy, admin_headers

pytestmark = pytest.mark.slow

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call><|im_end|>'
ANSWER = "The answer is three, and I am quite confident about that result."
SCRIPT = [CALL, ANSWER + "<|im_end|>", ANSWER + "<|im_end|>", "Yes, I am sure.<|im_end|>"]
O2_TOKENS = 4  # turn 2 is cut after this many tokens
TOOLS = [
    {
        "type": "function",
        "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}},
    }
]


@pytest.fixture(scope="module")
def proxy(tmp_path_factory, model_dir):
    p = start_proxy(tmp_path_factory.mktemp("rollback"), model_dir, script=SCRIPT)
    yield p
    kill_tree(p)


def _chat(proxy, sid: str, messages: list[dict], **extra) -> dict:
    r = httpx.post(
        proxy.url + "/v1/chat/completions",
        json={"model": "splice-model", "messages": messages, "tools": TOOLS, **extra},
        headers={"X-Session-Id": sid},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_rollback_extends_longest_active_prefix(proxy):
    sid = "rb-" + uuid.uuid4().hex[:10]
    user = {"role": "user", "content": "What is 1 + 2?"}
    c1 = _chat(proxy, sid, [user])
    m1 = c1["choices"][0]["message"]
    (tc,) = m1["tool_calls"]
    history = [user, {"role": "assistant", "content": m1.get("content"), "tool_calls": m1["tool_calls"]}, {"role": "tool", "tool_call_id": tc["id"], "content": "3"}]

    c2 = _chat(proxy, sid, history, max_tokens=O2_TOKENS)
    assert c2["choices"][0]["finish_reason"] == "length"
    c3 = _chat(proxy, sid, history)  # roll back turn 2: the same history again
    m3 = c3["choices"][0]["message"]
    assert m3["content"] == ANSWER and c3["choices"][0]["finish_reason"] == "stop"
    c4 = _chat(proxy, sid, history + [{"role": "assistant", "content": m3["content"]}, {"role": "user", "content": "Are you sure?"}])
    assert c4["choices"][0]["message"]["content"] == "Yes, I am sure."

    s = proxy.get(f"/v1/sessions/{sid}").json()
    t1, t2, t3, t4 = s["turns"]
    p1, O1 = t1["prompt_ids"], t1["output_ids"]
    p2, O2 = t2["prompt_ids"], t2["output_ids"]
    p3, O3 = t3["prompt_ids"], t3["output_ids"]
    p4, O4 = t4["prompt_ids"], t4["output_ids"]
    assert t2["spliced"] and t3["spliced"] and t4["spliced"], [t["fork_reason"] for t in s["turns"]]
    # the shape of seed 002
    assert p2[: len(p1) + len(O1)] == p1 + O1
    bridge2 = p2[len(p1) + len(O1):]
    assert len(O2) == O2_TOKENS and t2["finish_reason"] == "length"
    assert p3 == p2  # the rollback prompt ...
    A_tokens = p2 + O2
    assert len(p3) < len(A_tokens)  # ... is shorter than sample A, so it cannot extend it
    assert O3[: len(O2)] == O2 and len(O3) > len(O2)  # re-generates O2 and keeps going
    B_tokens = p3 + O3
    assert B_tokens[: len(A_tokens)] == A_tokens  # A is a strict prefix of B
    assert p4[: len(B_tokens)] == B_tokens  # turn 4 matches both A and B
    bridge4 = p4[len(B_tokens):]
    assert bridge4

    assert httpx.post(f"{proxy.url}/v1/sessions/{sid}/reward", json={"reward": 1.0}, headers=admin_headers(), timeout=30).status_code == 200
    pulled = httpx.post(proxy.url + "/v1/trajectories/pull", json={"max_samples": 100}, headers=admin_headers(), timeout=60).json()
    mine = [x for x in pulled["samples"] if x["session_id"] == sid]
    assert len(mine) == 2, [x["turn_ids"] for x in mine]
    A, B = mine
    assert A["turn_ids"] == [t1["turn_id"], t2["turn_id"]]
    assert B["turn_ids"] == [t3["turn_id"], t4["turn_id"]]

    assert A["input_ids"] == p1 + O1 + bridge2 + O2
    assert A["loss_mask"] == [0] * len(p1) + [1] * len(O1) + [0] * len(bridge2) + [1] * len(O2)
    assert B["input_ids"] == p3 + O3 + bridge4 + O4
    assert B["loss_mask"] == [0] * len(p3) + [1] * len(O3) + [0] * len(bridge4) + [1] * len(O4)
    # in completion coordinates (after the first prompt), as seed 002 writes them
    n = len(p1)
    assert A["loss_mask"][n:] == [1] * len(O1) + [0] * len(bridge2) + [1] * len(O2)
    assert B["loss_mask"][n:] == [0] * (len(O1) + len(bridge2)) + [1] * len(O3) + [0] * len(bridge4) + [1] * len(O4)
    # every token B's turns sampled is trained with its own behaviour logprob
    assert B["logprobs"] == [0.0] * len(p3) + t3["output_logprobs"] + [0.0] * len(bridge4) + t4["output_logprobs"]
    assert A["logprobs"] == [0.0] * len(p1) + t1["output_logprobs"] + [0.0] * len(bridge2) + t2["output_logprobs"]
    for smp in (A, B):
        L = len(smp["input_ids"])
        assert all(len(smp[k]) == L for k in ("loss_mask", "logprobs", "versions", "proximal_logprobs_t", "proximal_versions"))
        assert [v >= 0 for v in smp["versions"]] == [m == 1 for m in smp["loss_mask"]]
    assert httpx.post(proxy.url + "/v1/trajectories/ack", json={"lease_id": pulled["lease_id"]}, headers=admin_headers(), timeout=30).status_code == 200
