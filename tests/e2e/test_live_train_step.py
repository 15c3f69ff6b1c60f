"""One trainer step on CPU against a live splice serve + reference engine."""

from __future__ import annotations

import pytest
from openai import OpenAI

pytestmark = pytest.mark.slow


def test_one_step_publishes_a_new_version(proxy_factory, model_dir, tmp_path):
    from safetensors.torch import load_file

    from trainer_bridge.config import TrainConfig
    from trainer_bridge.train import train

    proxy = proxy_factory(script=["Four.<|im_end|>", "Five.<|im_end|>"])
    for k, reward in enumerate((1.0, 0.0)):
        sid = f"live-{k}"
        client = OpenAI(base_url=proxy.url + "/v1", api_key="x",
                        default_headers={"X-Session-Id": sid, "X-Group-Id": "g", "X-Group-Size": "2"})
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"2+{k + 2}?"}])
        assert proxy.post(f"/v1/sessions/{sid}/reward", {"reward": reward}).status_code == 200

    out = tmp_path / "train"
    stats = train(TrainConfig(proxies=[proxy.url], model=model_dir, out=str(out), steps=1, batch_samples=2,
                              min_samples=2, lr=1e-2, pull_wait_s=5, pull_timeout_s=60, progress=False))
    assert len(stats) == 1 and stats[0]["version"] == 1
    assert stats[0]["loss"] == stats[0]["loss"]  # finite, not NaN
    before = load_file(next((p for p in __import__("pathlib").Path(model_dir).glob("*.safetensors"))))
    after = load_file(next((out / "step_1").glob("*.safetensors")))
    assert any(not (before[k] == after[k]).all() for k in before if k in after)  # weights changed
    status = proxy.get("/admin/status").json()
    assert status["version"] == 1  # the proxy's version incremented
    info = __import__("httpx").get(status["engines"]["replicas"][0]["url"] + "/model_info", timeout=30).json()
    assert info["weight_version"] == "1"  # the engine serves the new weights
    again = proxy.post("/v1/trajectories/pull", {"max_samples": 10, "wait_s": 0}).json()
    assert again["samples"] == []  # the pulled samples were acked
