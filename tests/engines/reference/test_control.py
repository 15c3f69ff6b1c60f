"""Pause/continue, abort, request validation and streaming, over real HTTP."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import orjson
import pytest

PROMPT = [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]  # <|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n


def post(url, path, body=None, timeout=60):
    return httpx.post(url + path, json=body if body is not None else {}, timeout=timeout)


def long_request(url, rid=None, n=400):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": n}, "return_logprob": True}
    if rid:
        body["rid"] = rid
    return post(url, "/generate", body)


def wait_active(url, n=1, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if httpx.get(url + "/get_server_info").json()["active"] >= n:
            time.sleep(0.15)  # let a few tokens come out
            return
        time.sleep(0.02)
    raise AssertionError("request never became active")


@pytest.fixture
def pool():
    with ThreadPoolExecutor(4) as ex:
        yield ex


def test_pause_abort_returns_partial_and_blocks_new_requests(engine, pool):
    first = pool.submit(long_request, engine)
    wait_active(engine)
    assert post(engine, "/pause_generation", {"mode": "abort"}).status_code == 200
    r = first.result(timeout=10)
    assert r.status_code == 200
    out = r.json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(out["output_ids"]) < 400
    assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"])
    try:
        blocked = pool.submit(post, engine, "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
        time.sleep(0.5)
        assert not blocked.done(), "a request sent while paused must wait, not fail"
    finally:
        assert post(engine, "/continue_generation").status_code == 200
    r2 = blocked.result(timeout=10)
    assert r2.status_code == 200 and len(r2.json()["output_ids"]) == 2


def test_abort_request_by_rid_and_duplicate_rid(engine, pool):
    first = pool.submit(long_request, engine, "rid-dup")
    wait_active(engine)
    dup = long_request(engine, "rid-dup", n=1)
    assert dup.status_code == 400 and "rid-dup" in dup.json()["error"]["message"]
    assert post(engine, "/abort_request", {"rid": "rid-dup"}).status_code == 200
    out = first.result(timeout=10).json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and out["meta_info"]["id"] == "rid-dup"
    assert 0 < len(out["output_ids"]) < 400
    # once finished the rid is free again
    assert long_request(engine, "rid-dup", n=1).status_code == 200


def test_requests_progress_concurrently(engine, pool):
    first = pool.submit(long_request, engine, "long-one")
    wait_active(engine)
    short = long_request(engine, None, n=5)  # not queued behind the long one
    assert short.status_code == 200 and len(short.json()["output_ids"]) == 5
    assert not first.done()
    post(engine, "/abort_request", {"rid": "long-one"})
    assert first.result(timeout=10).json()["meta_info"]["finish_reason"]["type"] == "abort"


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"input_ids": PROMPT, "sampling_params": {"max_new_token": 3}}, "max_new_token"),
        ({"sampling_params": {"max_new_tokens": 3}}, "input_ids"),
        ({"input_ids": PROMPT, "sampling_params": {"n": 2}}, "'n'"),
        ({"input_ids": PROMPT, "sampling_params": {"top_p": 0}}, "top_p"),
        ({"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": len(PROMPT)}, "logprob_start_len"),
        ({"input_ids": [0, 10**7]}, "out of range"),
        ({"input_ids": [[1, 2], [3]]}, "batch"),
    ],
)
def test_sglang_rejects_bad_requests(engine, body, fragment):
    r = post(engine, "/generate", body)
    assert r.status_code == 400
    assert fragment in r.json()["error"]["message"]


def test_vllm_rejects_bad_requests(engine):
    assert post(engine, "/v1/completions", {"model": "other", "prompt": PROMPT}).status_code == 404
    r = post(engine, "/v1/completions", {"prompt": PROMPT, "logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["code"] == 400


def test_vllm_pause_resume(engine, pool):
    body = {"prompt": PROMPT, "max_tokens": 400, "return_token_ids": True, "logprobs": 0}
    first = pool.submit(post, engine, "/v1/completions", body)
    wait_active(engine)
    assert post(engine, "/pause?mode=abort").status_code == 200
    try:
        assert httpx.get(engine + "/is_paused").json() == {"is_paused": True}
        c = first.result(timeout=10).json()["choices"][0]
        assert c["finish_reason"] == "abort" and 0 < len(c["token_ids"]) < 400
        assert len(c["logprobs"]["token_logprobs"]) == len(c["token_ids"])
    finally:
        assert post(engine, "/resume").status_code == 200
    assert httpx.get(engine + "/is_paused").json() == {"is_paused": False}


def read_sse(url, path, body):
    frames = []
    with httpx.stream("POST", url + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                frames.append(line[len("data: ") :])
    return frames


def test_sglang_stream_frames_are_cumulative(engine):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8}, "return_logprob": True, "stream": True}
    frames = read_sse(engine, "/generate", body)
    assert frames[-1] == "[DONE]"
    objs = [orjson.loads(f) for f in frames[:-1]]
    # one frame per new token, or fewer when tokens arrive faster than frames are written
    assert 2 <= len(objs) <= 8 and len(objs[-1]["output_ids"]) == 8
    for prev, o in zip(objs, objs[1:]):
        n = len(prev["output_ids"])
        assert len(o["output_ids"]) > n and o["output_ids"][:n] == prev["output_ids"]
        assert o["meta_info"]["output_token_logprobs"][:n] == prev["meta_info"]["output_token_logprobs"]
        assert o["text"].startswith(prev["text"])
    assert all(len(o["meta_info"]["output_token_logprobs"]) == len(o["output_ids"]) for o in objs)
    assert all(o["meta_info"]["finish_reason"] is None for o in objs[:-1])
    assert objs[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_vllm_stream_frames_are_deltas(engine):
    body = {"prompt": PROMPT, "max_tokens": 6, "stream": True, "return_token_ids": True, "logprobs": 0,
            "return_tokens_as_token_ids": True, "stream_options": {"include_usage": True}}  # fmt: skip
    frames = read_sse(engine, "/v1/completions", body)
    assert frames[-1] == "[DONE]"
    objs = [orjson.loads(f) for f in frames[:-1]]
    usage = objs.pop()
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    ids = [t for o in objs for t in o["choices"][0]["token_ids"]]
    assert len(ids) == 6
    toks = [t for o in objs for t in o["choices"][0]["logprobs"]["tokens"]]
    assert toks == [f"token_id:{t}" for t in ids]
    assert objs[0]["choices"][0]["prompt_token_ids"] == PROMPT
    assert objs[-1]["choices"][0]["finish_reason"] == "length"
    assert all(o["choices"][0]["finish_reason"] is None for o in objs[:-1])


def test_stream_disconnect_aborts_the_request(engine):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 400}, "stream": True, "rid": "gone"}
    with httpx.stream("POST", engine + "/generate", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
    deadline = time.monotonic() + 5
    while httpx.get(engine + "/get_server_info").json()["active"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(engine + "/get_server_info").json()["active"] == 0
    assert long_request(engine, "gone", n=1).status_code == 200


def test_update_waits_for_running_generation(engine, model_dir, pool):
    first = pool.submit(long_request, engine, None, 40)
    wait_active(engine)
    r = post(engine, "/update_weights_from_disk", {"model_path": str(model_dir), "weight_version": "5"})
    assert r.json()["success"] is True
    # the generation finished under the old version before the update applied
    assert first.result(timeout=10).json()["meta_info"]["weight_version"] == "0"
    assert first.result().json()["meta_info"]["finish_reason"]["type"] == "length"
    post(engine, "/update_weights_from_disk", {"model_path": str(model_dir), "weight_version": "0"})


def test_health_and_info(engine):
    assert httpx.get(engine + "/health").status_code == 200
    models = httpx.get(engine + "/v1/models").json()
    assert models["data"][0]["id"] == "tiny"
    info = httpx.get(engine + "/get_server_info").json()
    assert info["paused"] is False and info["script_mode"] is False




def test_client_that_leaves_while_paused_is_never_run(engine):
    assert post(engine, "/pause_generation", {"mode": "abort"}).status_code == 200
    try:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(engine + "/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 400}, "rid": "left"}, timeout=0.3)
        time.sleep(0.2)
    finally:
        post(engine, "/continue_generation")
    time.sleep(0.2)
    info = httpx.get(engine + "/get_server_info").json()
    assert info["active"] == 0 and info["queued"] == 0


def test_non_streaming_client_disconnect_aborts(engine):
    with pytest.raises(httpx.TimeoutException):
        long_request_timeout = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 400}}
        httpx.post(engine + "/generate", json=long_request_timeout, timeout=0.3)
    deadline = time.monotonic() + 5
    while httpx.get(engine + "/get_server_info").json()["active"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(engine + "/get_server_info").json()["active"] == 0


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _joining(url) -> int:
    return httpx.get(url + "/get_model_info").json()["weight_update_groups_joining"]


def test_a_join_stops_when_its_caller_hangs_up(engine):
    """An engine asked to join a trainer it cannot reach stops trying once the caller (the
    proxy) gives up, instead of retrying for its own 600 s rendezvous timeout."""
    body = {"master_address": "127.0.0.1", "master_port": _closed_port(), "rank_offset": 1, "world_size": 2,
            "group_name": "nobody-home", "backend": "gloo"}  # fmt: skip
    with pytest.raises(httpx.ReadTimeout):
        post(engine, "/init_weights_update_group", body, timeout=1.0)
    deadline = time.monotonic() + 10
    while _joining(engine) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _joining(engine) == 0
    assert "nobody-home" not in httpx.get(engine + "/get_model_info").json()["weight_update_groups"]
