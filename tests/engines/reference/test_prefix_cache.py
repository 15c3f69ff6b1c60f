"""Prefix reuse in the reference engine: a prompt extending a finished sequence prefills only
its new tokens, and every logprob equals a full forward pass of the whole sequence (the oracle:
transformers' own non-incremental forward); weight updates invalidate; memory stays bounded."""

from __future__ import annotations

import httpx
import pytest

from engines.reference.generator import Job, Worker
from engines.reference.lm import LanguageModel
from engines.reference.prefix_cache import PrefixCache
from engines.reference.sampling import GenParams
from engines.reference.testing import start_engine_in_thread

from .conftest import Oracle

TOL = 1e-4


def _params(n: int, seed: int = 0) -> GenParams:
    return GenParams(max_new_tokens=n, ignore_eos=True, seed=seed)


def _run(worker: Worker, ids: list[int], n: int, *, logprobs_from: int | None = None, rid: str = "r") -> Job:
    job = Job(rid=rid, input_ids=list(ids), params=_params(n), input_logprobs_from=logprobs_from)
    worker.submit(job)
    assert job.done.wait(120)
    return job


@pytest.fixture(scope="module")
def worker(model_dir):
    w = Worker(LanguageModel(model_dir), prefix_cache=PrefixCache(256 * 1024 * 1024))
    w.start()
    yield w
    w.stop()


def _spliced_prompt(oracle: Oracle, first: Job) -> list[int]:
    """What a spliced second turn sends: the first prompt + its output + a bridge (a tool result)."""
    bridge = oracle.tokenizer("<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
                              "<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]  # fmt: skip
    return first.input_ids + first.output_ids + list(bridge)


def test_spliced_prompt_reuses_the_prefix_with_full_forward_logprobs(worker, oracle):
    prompt = oracle.chat_prompt("Explain prefix caching in two sentences. " * 40)  # > one 512-token chunk
    first = _run(worker, prompt, 24, rid="t1")
    assert first.cached_tokens == 0
    second_prompt = _spliced_prompt(oracle, first)
    start = len(first.input_ids) + len(first.output_ids)  # the proxy asks for the bridge's logprobs (R2)
    second = _run(worker, second_prompt, 24, logprobs_from=start, rid="t2")
    # everything before the bridge came from the cache (the first job's last token was never fed back)
    assert second.cached_tokens == start - 1
    full = oracle.logprobs(second_prompt + second.output_ids)
    got_prompt = second.input_logprobs[1:]  # entry 0 (position `start`) is None, as SGLang reports
    want_prompt = full[start + 1 : len(second_prompt)]
    assert len(got_prompt) == len(want_prompt) > 0
    assert max(abs(a - b) for a, b in zip(got_prompt, want_prompt)) < TOL
    want_out = full[len(second_prompt) :]
    assert max(abs(a - b) for a, b in zip(second.output_logprobs, want_out)) < TOL
    # the first turn's output logprobs are the oracle's too (decode steps built the cached KV)
    want_first = oracle.logprobs(first.input_ids + first.output_ids)[len(first.input_ids) :]
    assert max(abs(a - b) for a, b in zip(first.output_logprobs, want_first)) < TOL


def test_a_sibling_reuses_the_common_prefix_only(worker, oracle):
    prompt = oracle.chat_prompt("Name three rivers. " * 30)
    a = _run(worker, prompt, 16, rid="s1")
    sibling = prompt + [oracle.tokenizer.convert_tokens_to_ids("Hello")] + a.output_ids[:3]  # diverges after the prompt
    b = _run(worker, sibling, 8, rid="s2")
    assert b.cached_tokens == len(prompt)
    full = oracle.logprobs(sibling + b.output_ids)
    assert max(abs(x - y) for x, y in zip(b.output_logprobs, full[len(sibling) :])) < TOL


def test_prompt_logprobs_from_the_start_are_never_served_from_the_cache(worker, oracle):
    prompt = oracle.chat_prompt("Count to ten. " * 20)
    _run(worker, prompt, 8, rid="p1")
    again = _run(worker, prompt, 4, logprobs_from=0, rid="p2")
    assert again.cached_tokens == 0
    full = oracle.logprobs(prompt)
    assert max(abs(a - b) for a, b in zip(again.input_logprobs[1:], full[1:])) < TOL


def test_weight_update_invalidates(model_dir, perturbed_dir, oracle_v1):
    w = Worker(LanguageModel(model_dir), prefix_cache=PrefixCache(256 * 1024 * 1024))
    w.start()
    try:
        prompt = oracle_v1.chat_prompt("Describe the sea. " * 30)
        first = _run(w, prompt, 16, rid="u1")
        assert w.prefix.stats()["entries"] == 1
        ok, msg = w.update_weights(str(perturbed_dir), "1").result(timeout=60)
        assert ok, msg
        assert w.prefix.stats()["entries"] == 0
        nxt = first.input_ids + first.output_ids + first.output_ids[:4]
        second = _run(w, nxt, 8, rid="u2")
        assert second.cached_tokens == 0  # the old KV is not the new model's
        full = oracle_v1.logprobs(nxt + second.output_ids)
        assert max(abs(a - b) for a, b in zip(second.output_logprobs, full[len(nxt) :])) < TOL
    finally:
        w.stop()


def test_memory_stays_under_the_budget(model_dir, oracle):
    lm = LanguageModel(model_dir)
    per_token = 2 * lm.config.num_hidden_layers * lm.config.num_key_value_heads * lm.config.head_dim * 4  # K and V, float32
    budget = 700 * per_token  # room for one ~600-token sequence, not two
    w = Worker(lm, prefix_cache=PrefixCache(budget))
    w.start()
    try:
        a = oracle.chat_prompt("alpha " * 550)
        b = oracle.chat_prompt("beta " * 550)
        _run(w, a, 4, rid="m1")
        assert w.prefix.stats()["entries"] == 1 and w.prefix.nbytes <= budget
        _run(w, b, 4, rid="m2")
        assert w.prefix.stats()["entries"] == 1 and w.prefix.nbytes <= budget  # the older one was evicted
        assert _run(w, b + [11], 2, rid="m3").cached_tokens == len(b)
        assert _run(w, a + [11], 2, rid="m4").cached_tokens == 0
    finally:
        w.stop()


def test_sglang_reports_cached_tokens_over_http(model_dir, oracle):
    url, stop = start_engine_in_thread(model_dir)
    try:
        prompt = oracle.chat_prompt("What is a KV cache? " * 10)
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 1.0}, "return_logprob": True}
        r1 = httpx.post(url + "/generate", json=body, timeout=60).json()
        assert r1["meta_info"]["cached_tokens"] == 0
        nxt = prompt + r1["output_ids"] + oracle.tokenizer("<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n",
                                                           add_special_tokens=False)["input_ids"]  # fmt: skip
        r2 = httpx.post(url + "/generate", json={**body, "input_ids": nxt}, timeout=60).json()
        assert r2["meta_info"]["cached_tokens"] == len(prompt) + len(r1["output_ids"]) - 1
        full = oracle.logprobs(nxt + r2["output_ids"])
        got = [x[0] for x in r2["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(got, full[len(nxt) :])) < TOL
        info = httpx.get(url + "/get_server_info", timeout=10).json()["prefix_cache"]
        assert info["hits"] == 1 and info["reused_tokens"] == r2["meta_info"]["cached_tokens"]
    finally:
        stop()
