"""The engine-trainer agreement gate on real processes: an engine serving other weights than the
trainer's stops `splice train` with the gate's message, before anything is published."""

from __future__ import annotations

import json

import pytest
from openai import OpenAI

pytestmark = pytest.mark.slow


def _sessions(proxy, n: int) -> None:
    for k in range(n):
        sid = f"gate-{k}"
        client = OpenAI(base_url=proxy.url + "/v1", api_key="x",
                        default_headers={"X-Session-Id": sid, "X-Group-Id": "g", "X-Group-Size": str(n)})
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"Count to {k + 3}."}])
        assert proxy.post(f"/v1/sessions/{sid}/reward", {"reward": float(k)}).status_code == 200


def test_engine_with_other_weights_stops_training_with_the_gates_message(proxy_factory, model_dir, tmp_path, capsys):
    from engines.reference.model_init import perturb_model
    from trainer_bridge.agreement import EXIT_CODE
    from trainer_bridge.train import main

    proxy = proxy_factory(script=["One two three.<|im_end|>", "One, two, three, four.<|im_end|>"])
    _sessions(proxy, 2)
    other = perturb_model(model_dir, tmp_path / "other-weights", seed=3, scale=0.5)  # not what the engine serves
    out = tmp_path / "train"
    code = main(["--proxy", proxy.url, "--model", str(other), "--out", str(out), "--steps", "3",
                 "--batch-samples", "2", "--min-samples", "2", "--pull-wait-s", "5", "--pull-timeout-s", "60",
                 "--no-progress", "--agreement-patience", "1"])
    err = capsys.readouterr().err
    assert code == EXIT_CODE
    assert "engine and trainer disagree on the same weights" in err and "tied LM head" in err and "dtype" in err
    record = json.loads((out / "stats.jsonl").read_text().splitlines()[-1])
    assert record["agreement_stopped"] is True and record["token_mult_prob_error"] > 1.1
    assert record["agreement_tokens"] > 0 and record["agreement_abs_gap_max"] > 0.05
    status = proxy.get("/admin/status").json()
    assert status["version"] == 0  # nothing was published
    assert not (out / "step_1").exists()


def test_engine_with_the_trainers_weights_passes_the_gate(proxy_factory, model_dir, tmp_path):
    """The control: the same run with the engine's own weights trains and publishes, agreement ~1."""
    from trainer_bridge.config import TrainConfig
    from trainer_bridge.train import train

    proxy = proxy_factory(script=["One two three.<|im_end|>", "One, two, three, four.<|im_end|>"])
    _sessions(proxy, 2)
    stats = train(TrainConfig(proxies=[proxy.url], model=model_dir, out=str(tmp_path / "train"), steps=1,
                              batch_samples=2, min_samples=2, pull_wait_s=5, pull_timeout_s=60, progress=False,
                              agreement_patience=1))
    assert stats[0]["agreement_stopped"] is False and stats[0]["version"] == 1
    assert stats[0]["token_mult_prob_error"] == pytest.approx(1.0, abs=1e-3)
    assert stats[0]["agreement_token_share"] == pytest.approx(1.0)  # every loss token sampled by v0 = the trainer's
