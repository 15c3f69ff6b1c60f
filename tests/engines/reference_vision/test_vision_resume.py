"""Abort-resume with images (the prompt re-sent with the partial output and the same images)
gives the uninterrupted values; weight updates from disk reach the vision model."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from safetensors import safe_open

from tests.engines.reference_vision.helpers import assert_close, data_url, post

N = 40


@pytest.fixture(scope="module")
def prompt(oracle, images):
    text = oracle.chat_text([{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}, {"type": "text", "text": "go on"}])
    return oracle.collapsed_ids(text), oracle.expanded(text, images)[0], images


def _generating(url: str, timeout_s: float = 60.0) -> None:
    """Until the engine is stepping a request, then a quarter second more (some tokens out). A
    fixed sleep alone paused a busy machine's engine before the request arrived: it then waited
    at the pause gate, and the test waited for it."""
    deadline = time.monotonic() + timeout_s
    while httpx.get(url + "/server_info", timeout=30).json()["active"] < 1:
        assert time.monotonic() < deadline, "the request never started generating"
        time.sleep(0.02)
    time.sleep(0.25)


def _interrupt(url: str, send, pause_path: str, resume_path: str):
    """Run ``send()`` in a thread, abort it mid-generation by pausing, then resume the engine."""
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(send)
        try:
            _generating(url)
            assert httpx.post(url + pause_path, json={"mode": "abort"} if "generation" in pause_path else None, timeout=30).status_code == 200
            out = fut.result(timeout=60)
        finally:  # never leave the engine paused for the tests after this one
            resumed = httpx.post(url + resume_path, json={}, timeout=30)
    assert resumed.status_code == 200
    return out


def test_sglang_abort_resume_with_images_equals_uninterrupted(vengine, oracle, prompt):
    ids, expanded, imgs = prompt
    urls = [data_url(b) for b in imgs]

    def gen(input_ids, n, rid=None):
        body = {"input_ids": input_ids, "image_data": urls, "return_logprob": True, "rid": rid,
                "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
        return post(vengine, "/generate", body)

    whole = gen(ids, N)
    part = _interrupt(vengine, lambda: gen(ids, N, rid="vl-resume"), "/pause_generation", "/continue_generation")
    assert part["meta_info"]["finish_reason"]["type"] == "abort"
    k = len(part["output_ids"])
    assert 0 < k < N, k
    rest = gen(ids + part["output_ids"], N - k)  # the old prompt + partial output, the same images
    assert rest["meta_info"]["prompt_tokens"] == len(expanded) + k
    assert part["output_ids"] + rest["output_ids"] == whole["output_ids"]
    lps = [e[0] for e in part["meta_info"]["output_token_logprobs"] + rest["meta_info"]["output_token_logprobs"]]
    assert_close(lps, [e[0] for e in whole["meta_info"]["output_token_logprobs"]], "resumed vs whole", tol=1e-5)
    want = oracle.logprobs(expanded + whole["output_ids"], imgs)
    assert_close(lps, want[len(expanded) :], "resumed vs oracle")


def test_vllm_abort_resume_with_images_equals_uninterrupted(vengine, oracle, prompt):
    ids, expanded, imgs = prompt
    parts = [{"type": "image_url", "url": data_url(b)} for b in imgs]

    def gen(token_ids, n):
        body = {"token_ids": token_ids, "content_parts": parts, "return_token_ids": True,
                "sampling_params": {"max_tokens": n, "temperature": 0, "ignore_eos": True, "logprobs": 0}}
        return post(vengine, "/inference/v1/generate", body)

    whole = gen(ids, N)["choices"][0]
    part_resp = _interrupt(vengine, lambda: gen(ids, N), "/pause?mode=abort", "/resume")
    part = part_resp["choices"][0]
    assert part["finish_reason"] == "abort"
    k = len(part["token_ids"])
    assert 0 < k < N, k
    rest_resp = gen(ids + part["token_ids"], N - k)
    assert rest_resp["prompt_token_ids"] == expanded + part["token_ids"]
    rest = rest_resp["choices"][0]
    assert part["token_ids"] + rest["token_ids"] == whole["token_ids"]
    lps = [c["logprob"] for c in part["logprobs"]["content"] + rest["logprobs"]["content"]]
    assert_close(lps, [c["logprob"] for c in whole["logprobs"]["content"]], "resumed vs whole", tol=1e-5)


def test_vllm_abort_requests_by_id(vengine, prompt):
    ids, _, imgs = prompt
    body = {"request_id": "vl-abort-me", "token_ids": ids, "content_parts": [{"type": "image_url", "url": data_url(b)} for b in imgs],
            "sampling_params": {"max_tokens": 200, "ignore_eos": True}}
    with ThreadPoolExecutor(1) as ex:
        fut = ex.submit(post, vengine, "/inference/v1/generate", body)
        _generating(vengine)
        assert httpx.post(vengine + "/inference/v1/abort_requests", json={"request_ids": ["vl-abort-me"]}, timeout=30).status_code == 200
        choice = fut.result(timeout=60)["choices"][0]
    assert choice["finish_reason"] == "abort" and 0 < len(choice["token_ids"]) < 200


def test_weight_updates_from_disk_reach_the_vision_model(vengine, vision_dir, perturbed_vision_dir, oracle, oracle_v1, prompt):
    ids, expanded, imgs = prompt
    body = {"input_ids": ids, "image_data": [data_url(b) for b in imgs], "return_logprob": True, "logprob_start_len": len(expanded) - 3,
            "sampling_params": {"max_new_tokens": 5, "sampling_seed": 1, "ignore_eos": True}}
    try:
        r = post(vengine, "/update_weights_from_disk", {"model_path": str(perturbed_vision_dir), "weight_version": "1"})
        assert r["success"], r
        out = post(vengine, "/generate", body)
        assert out["meta_info"]["weight_version"] == "1"
        want = oracle_v1.logprobs(expanded + out["output_ids"], imgs)
        assert_close([e[0] for e in out["meta_info"]["output_token_logprobs"]], want[len(expanded) :], "v1 output")
        got_in = [e[0] for e in out["meta_info"]["input_token_logprobs"]]
        assert got_in[0] is None  # SGLang's layout: the entry at logprob_start_len is null
        assert_close(got_in[1:], want[len(expanded) - 2 : len(expanded)], "v1 input")
        # checkpoint names (visual.*, model.layers.*) address the model's parameters
        name = "visual.blocks.0.attn.qkv.weight"
        with safe_open(str(perturbed_vision_dir / "model.safetensors"), "pt") as f:
            want_rows = f.get_tensor(name)[:2].tolist()
        got = post(vengine, "/get_weights_by_name", {"name": name, "truncate_size": 2})
        assert got == want_rows  # float32 values, exactly
    finally:
        r = post(vengine, "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(vision_dir)}})
        assert r == {"results": [None]}
    out = post(vengine, "/generate", body)
    want = oracle.logprobs(expanded + out["output_ids"], imgs)
    assert_close([e[0] for e in out["meta_info"]["output_token_logprobs"]], want[len(expanded) :], "v0 output")
