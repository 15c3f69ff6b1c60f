"""Script mode: exact scripted ids, real logprobs of the forced tokens, deterministic abort-resume."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

IM_END = 151645


@pytest.fixture(scope="module")
def entries(oracle, script_texts):
    ids = [list(oracle.tokenizer(t, add_special_tokens=False)["input_ids"]) for t in script_texts]
    return [e if e[-1] == IM_END else e + [IM_END] for e in ids]


def generate(url, ids, **sp):
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 256, "skip_special_tokens": False, "no_stop_trim": True, **sp},
            "return_logprob": True}  # fmt: skip
    r = httpx.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(autouse=True)
def fresh_counter(script_engine, script_texts):
    """Each test starts from entry 0: consume entries until the global counter wraps around."""
    used = httpx.get(script_engine + "/get_server_info").json()["script_counter"]
    for _ in range((-used) % len(script_texts)):
        generate(script_engine, [1, 2, 3], max_new_tokens=1)


def test_entries_emitted_in_order_with_real_logprobs(script_engine, oracle, entries):
    prompt = oracle.chat_prompt("add 1 and 2")
    first = generate(script_engine, prompt)
    assert first["output_ids"] == entries[0]
    assert first["meta_info"]["finish_reason"] == {"type": "stop", "matched": IM_END}
    assert "<tool_call>" in first["text"] and first["text"].endswith("<|im_end|>")
    want = oracle.logprobs(prompt + entries[0])[len(prompt) :]
    got = [e[0] for e in first["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
    second = generate(script_engine, prompt + first["output_ids"])
    assert second["output_ids"] == entries[1]
    third = generate(script_engine, prompt)
    assert third["output_ids"] == entries[2]  # an entry without an end token gets <|im_end|> appended
    again = generate(script_engine, prompt, no_stop_trim=False)  # cycles
    assert again["output_ids"] == entries[0]  # the stop token stays in the ids ...
    assert again["text"] == first["text"][: -len("<|im_end|>")]  # ... but SGLang trims it from the text


def test_prefill_only_calls_do_not_consume_entries(script_engine, entries):
    generate(script_engine, [5, 6, 7], max_new_tokens=0)
    assert generate(script_engine, [5, 6, 7])["output_ids"] == entries[0]


def test_abort_then_resume_continues_the_same_entry(script_engine, entries):
    prompt = [151644, 77091, 198]
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(generate, script_engine, prompt)
        time.sleep(0.3)  # ~15 tokens at 20 ms
        httpx.post(script_engine + "/pause_generation", json={"mode": "abort"}, timeout=30)
        part = fut.result(timeout=10)
    httpx.post(script_engine + "/continue_generation", json={}, timeout=30)
    got = part["output_ids"]
    assert part["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(got) < len(entries[0]) and got == entries[0][: len(got)]
    rest = generate(script_engine, prompt + got)
    assert got + rest["output_ids"] == entries[0]
    assert generate(script_engine, prompt)["output_ids"] == entries[1]  # the next fresh request moves on


def test_stop_string_and_stop_token_in_script(script_engine, entries):
    generate(script_engine, [9], max_new_tokens=1)  # skip to entry 1: "The answer is 3. STOP here, ..."
    out = generate(script_engine, [9], stop=["STOP"], no_stop_trim=False)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "STOP"}
    assert out["text"] == "The answer is 3. "  # trimmed at the stop string; ids keep what was emitted
    assert out["output_ids"] == entries[1][: len(out["output_ids"])]
    stop_id = entries[2][2]  # entry 2 is next
    out = generate(script_engine, [9], stop_token_ids=[stop_id])
    assert out["output_ids"] == entries[2][:3]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}


def test_max_new_tokens_cuts_a_script_entry(script_engine, entries):
    out = generate(script_engine, [9], max_new_tokens=4)
    assert out["output_ids"] == entries[0][:4]
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 4}
