"""``start_engine``: the engine as a real subprocess, as other test suites use it."""

from __future__ import annotations

import httpx


def test_start_engine_subprocess(subprocess_engine):
    url, stop = subprocess_engine.result(timeout=120)  # started by the session fixture in conftest
    try:
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/model_info").json()["weight_version"] == "3"
        out = httpx.post(url + "/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}}, timeout=60).json()
        assert len(out["output_ids"]) == 3 and out["meta_info"]["weight_version"] == "3"
        models = httpx.get(url + "/v1/models").json()
        assert models["data"][0]["id"] == "tiny-sub"
    finally:
        stop()
        stop()  # idempotent
    try:
        httpx.get(url + "/health", timeout=1)
        raise AssertionError("engine still answering after stop()")
    except httpx.HTTPError:
        pass
