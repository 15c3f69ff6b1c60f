"""Logprobs the engine reports equal a direct forward pass of the same weights."""

from __future__ import annotations

import httpx
import pytest

TOL = 1e-4


def generate(url, ids, **kw):
    body = {"input_ids": ids, "sampling_params": kw.pop("sampling_params", {}), **kw}
    r = httpx.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def assert_close(got, want, what):
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        if w is None:
            assert g is None, f"{what}[{i}] should be null"
        else:
            assert g is not None and abs(g - w) < TOL, f"{what}[{i}]: {g} vs {w}"


def test_sampled_and_prompt_logprobs_equal_a_forward_pass(engine, oracle):
    prompt = oracle.chat_prompt("What is 1 + 2?")
    out = generate(engine, prompt, sampling_params={"max_new_tokens": 12}, return_logprob=True, logprob_start_len=0)
    meta = out["meta_info"]
    ids = out["output_ids"]
    assert len(ids) == meta["completion_tokens"] == 12
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["prompt_tokens"] == len(prompt) and meta["weight_version"] == "0"
    want = oracle.logprobs(prompt + ids)
    assert [e[1] for e in meta["output_token_logprobs"]] == ids
    assert_close([e[0] for e in meta["output_token_logprobs"]], want[len(prompt) :], "output")
    assert [e[1] for e in meta["input_token_logprobs"]] == prompt
    assert_close([e[0] for e in meta["input_token_logprobs"]], want[: len(prompt)], "input")
    # neighbouring tokens have clearly different values, so a one-position shift cannot pass
    vals = [e[0] for e in meta["output_token_logprobs"]]
    assert min(abs(a - b) for a, b in zip(vals, vals[1:])) > 10 * TOL or len(set(round(v, 3) for v in vals)) > 6


@pytest.mark.parametrize("start", [1, 5, "last"])
def test_logprob_start_len_layout(engine, oracle, start):
    prompt = oracle.chat_prompt("layout check")
    n = len(prompt) - 1 if start == "last" else start
    meta = generate(engine, prompt, sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=n)["meta_info"]
    entries = meta["input_token_logprobs"]
    assert len(entries) == len(prompt) - n  # one per position N..L-1
    assert entries[0][0] is None  # the first entry is always null
    assert [e[1] for e in entries] == prompt[n:]
    assert_close([e[0] for e in entries[1:]], oracle.logprobs(prompt)[n + 1 :], f"input from {n}")


def test_no_input_logprobs_by_default_and_prefill_only(engine, oracle):
    prompt = oracle.chat_prompt("prefill")
    out = generate(engine, prompt, sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=-1)
    assert out["output_ids"] == [] and out["text"] == ""
    assert out["meta_info"]["input_token_logprobs"] == [] and out["meta_info"]["output_token_logprobs"] == []
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert "input_token_logprobs" not in generate(engine, prompt, sampling_params={"max_new_tokens": 1})["meta_info"]


def test_output_logprobs_scaled_by_temperature_prompt_logprobs_not(engine, oracle):
    prompt = oracle.chat_prompt("temperature")
    out = generate(engine, prompt, sampling_params={"max_new_tokens": 6, "temperature": 0.7}, return_logprob=True, logprob_start_len=0)
    ids = out["output_ids"]
    scaled = oracle.logprobs(prompt + ids, temperature=0.7)
    assert_close([e[0] for e in out["meta_info"]["output_token_logprobs"]], scaled[len(prompt) :], "scaled output")
    assert_close([e[0] for e in out["meta_info"]["input_token_logprobs"]], oracle.logprobs(prompt), "raw input")


def test_greedy_is_argmax_and_seed_reproduces(engine, oracle):
    prompt = oracle.chat_prompt("greedy")
    a = generate(engine, prompt, sampling_params={"max_new_tokens": 4, "temperature": 0})["output_ids"]
    assert a == generate(engine, prompt, sampling_params={"max_new_tokens": 4, "temperature": 0})["output_ids"]
    s1 = generate(engine, prompt, sampling_params={"max_new_tokens": 5, "sampling_seed": 7})["output_ids"]
    assert s1 == generate(engine, prompt, sampling_params={"max_new_tokens": 5, "sampling_seed": 7})["output_ids"]


def test_vllm_completions_echo_shape_and_raw_logprobs(engine, oracle):
    prompt = oracle.chat_prompt("vllm echo")
    body = {
        "model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0.5, "logprobs": 0, "echo": True,
        "return_tokens_as_token_ids": True, "return_token_ids": True, "skip_special_tokens": False,
    }  # fmt: skip
    r = httpx.post(engine + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    resp = r.json()
    assert resp["object"] == "text_completion" and resp["model"] == "tiny"
    c = resp["choices"][0]
    out = c["token_ids"]
    assert c["prompt_token_ids"] == prompt and len(out) == 5
    assert c["finish_reason"] == "length" and c["stop_reason"] is None
    lp = c["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in prompt + out]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert_close(lp["token_logprobs"], oracle.logprobs(prompt + out), "echo logprobs (raw, not temperature-scaled)")
    assert lp["top_logprobs"][-1] == {f"token_id:{out[-1]}": lp["token_logprobs"][-1]}
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert resp["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 5, "total_tokens": len(prompt) + 5, "prompt_tokens_details": None}


def test_vllm_prompt_logprobs_and_defaults(engine, oracle):
    prompt = oracle.chat_prompt("prompt logprobs")
    r = httpx.post(engine + "/v1/completions", json={"prompt": prompt, "prompt_logprobs": 1, "logprobs": 2}, timeout=60)
    c = r.json()["choices"][0]
    assert len(r.json()["choices"][0]["logprobs"]["tokens"]) == 16  # max_tokens defaults to 16
    plp = c["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(prompt)
    want = oracle.logprobs(prompt)
    for pos in range(1, len(prompt)):
        entry = plp[pos][str(prompt[pos])]
        assert abs(entry["logprob"] - want[pos]) < TOL and entry["rank"] >= 1
        assert min(v["rank"] for v in plp[pos].values()) == 1
    assert all(len(t) in (2, 3) for t in c["logprobs"]["top_logprobs"])  # sampled + top-2 (deduplicated)


def test_weight_update_changes_logprobs_and_version(engine, model_dir, perturbed_dir, oracle, oracle_v1):
    """The model ties its LM head (as Qwen3-0.6B does): after the update the head is the new
    embedding too, as SGLang's loader does it (docs/engines.md, "Tied LM heads")."""
    import json as _json

    assert _json.loads((model_dir / "config.json").read_text())["tie_word_embeddings"] is True
    prompt = oracle.chat_prompt("weights")
    try:
        r = httpx.post(engine + "/update_weights_from_disk", json={"model_path": str(perturbed_dir), "weight_version": "7"}, timeout=60)
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        meta = generate(engine, prompt, sampling_params={"max_new_tokens": 3}, return_logprob=True, logprob_start_len=0)
        assert meta["meta_info"]["weight_version"] == "7"
        new = oracle_v1.logprobs(prompt + meta["output_ids"])
        got = [e[0] for e in meta["meta_info"]["input_token_logprobs"]] + [e[0] for e in meta["meta_info"]["output_token_logprobs"]]
        assert_close(got, new, "logprobs under the new weights")
        old = oracle.logprobs(prompt)
        assert max(abs(a - b) for a, b in zip(old[1:], new[1 : len(prompt)])) > 1e-2  # the update really changed them
        info = httpx.get(engine + "/model_info").json()
        assert info["weight_version"] == "7" and info["model_path"] == str(perturbed_dir) and info["is_generation"] is True
        bad = httpx.post(engine + "/update_weights_from_disk", json={"model_path": "/nonexistent/dir", "weight_version": "8"}, timeout=60)
        assert bad.status_code == 400 and bad.json()["success"] is False and bad.json()["message"]
        assert httpx.get(engine + "/model_info").json()["weight_version"] == "7"
    finally:
        r = httpx.post(engine + "/update_weights_from_disk", json={"model_path": str(model_dir), "weight_version": "0"}, timeout=60)
        assert r.json()["success"] is True
    assert_close([e[0] for e in generate(engine, prompt, sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0)["meta_info"]["input_token_logprobs"]], oracle.logprobs(prompt), "restored")
