"""The trainer loop end to end on a tiny local model, against a mocked proxy."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import respx
import torch
from safetensors.torch import load_file

from splice_trainer_testlib import make_samples
from trainer_bridge.config import TrainConfig, config_from_argv
from trainer_bridge.policy import Policy, load_causal_lm
from trainer_bridge.train import main, prepare_batch, train

URL = "http://proxy.test"
STEP_KEYS = {
    "step", "version", "loss", "clip_frac", "dual_clip_frac", "behav_imp_weight_mean", "behav_imp_weight_std",
    "behav_imp_weight_max", "behav_kl_mean", "masked_frac", "entropy_mean", "staleness_mean", "staleness_max",
    "reward_mean", "loss_tokens", "tokens", "step_time_s", "pull_time_s", "n_dropped_stale", "grad_norm",
    "first_minibatch_ratio_dev",
}


def config(tiny_model_dir, out, **kw) -> TrainConfig:
    base = dict(proxies=[URL], model=str(tiny_model_dir), out=str(out), admin_token="adm", steps=1,
                micro_batch_tokens=64, lr=1e-3, progress=False, pull_wait_s=0.5)
    base.update(kw)
    return TrainConfig(**base)


class FakeProxy:
    """An in-process stand-in for the proxy's admin/pull HTTP API, mounted with respx."""

    def __init__(self, batches, version=5):
        self.batches = list(batches)
        self.version = version
        self.log: list[tuple[str, dict]] = []
        self.leases = 0

    def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        payload = json.loads(request.content) if request.content else {}
        self.log.append((path, payload))
        assert request.headers["authorization"] == "Bearer adm"
        if path == "/admin/status":
            return httpx.Response(200, json={"version": self.version, "paused": False})
        if path == "/v1/trajectories/pull":
            samples = self.batches.pop(0) if self.batches else []
            self.leases += 1
            return httpx.Response(200, json={"schema_version": 3, "lease_id": f"L{self.leases}", "samples": samples})
        if path == "/admin/update_weights":
            self.version = payload["version"]
        return httpx.Response(200, json={})


def test_two_steps_against_mocked_proxy(tiny_model_dir, tmp_path):
    stale = make_samples(n_groups=1, group_size=2, seed=9, version=0, prefix="old")  # older than max_staleness allows
    batches = [make_samples(seed=1) + stale, make_samples(seed=2, version=6)]
    proxy = FakeProxy(batches)
    with respx.mock:
        respx.route(host="proxy.test").mock(side_effect=proxy.handle)
        history = train(config(tiny_model_dir, tmp_path / "out", steps=2, ppo_n_minibatches=2, keep_last=1, max_staleness=2))

    assert [h["version"] for h in history] == [6, 7]
    paths = [p for p, _ in proxy.log]
    assert paths == [
        "/admin/status",
        "/v1/trajectories/pull", "/admin/pause", "/admin/update_weights", "/admin/resume", "/v1/trajectories/ack",
        "/v1/trajectories/pull", "/admin/pause", "/admin/update_weights", "/admin/resume", "/v1/trajectories/ack",
    ]
    updates = [b for p, b in proxy.log if p == "/admin/update_weights"]
    out = (tmp_path / "out").absolute()
    assert updates == [{"model_path": str(out / "step_1"), "version": 6}, {"model_path": str(out / "step_2"), "version": 7}]
    assert [b for p, b in proxy.log if p == "/v1/trajectories/ack"] == [{"lease_id": "L1"}, {"lease_id": "L2"}]
    assert proxy.log[1][1] == {"max_samples": 8, "wait_s": 0.5}

    first = history[0]
    assert STEP_KEYS <= first.keys()
    assert first["n_dropped_stale"] == len(stale) and first["n_samples"] == len(batches[0]) - len(stale)
    assert first["first_minibatch_ratio_dev"] == 0.0  # proximal pass == first training pass, bit for bit
    assert first["staleness_max"] == 1 and 0 < first["staleness_mean"] < 1
    assert first["n_minibatches"] == 2 and first["loss_tokens"] > 0
    # the synthetic behaviour logprobs are not the model's: a visible trainer/engine gap
    assert first["engine_gap_tokens"] > 0 and first["engine_gap_abs_max"] > 0.1

    # weights: a safetensors HF directory with the tokenizer files; only the newest kept
    assert not (out / "step_1").exists()
    step2 = out / "step_2"
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in step2.iterdir()}
    before, after = load_file(tiny_model_dir / "model.safetensors"), load_file(step2 / "model.safetensors")
    assert before.keys() == after.keys() and any(not torch.equal(before[k], after[k]) for k in before)

    lines = [json.loads(line) for line in (out / "stats.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2] and lines[1]["version"] == 7


class FakeClient:
    """The ProxyClient methods train() uses, without HTTP."""

    def __init__(self, batches, version=5):
        self.batches, self._version, self.calls = list(batches), version, []

    def version(self):
        return self._version

    def pull(self, max_samples, wait_s):
        self.calls.append(("pull", max_samples))
        batch = self.batches.pop(0) if self.batches else []
        return (f"L{len(self.calls)}" if batch else None), batch

    def ack(self, lease):
        self.calls.append(("ack", lease))

    def publish(self, path, version):
        self.calls.append(("publish", Path(path).name, version))


def test_stops_when_nothing_trainable_arrives(tiny_model_dir, tmp_path):
    stale = make_samples(n_groups=1, group_size=2, version=0)
    client = FakeClient([stale])
    history = train(config(tiny_model_dir, tmp_path, steps=3, max_staleness=1, pull_timeout_s=0.3), client=client)
    assert history == []
    assert ("ack", "L1") in client.calls  # stale samples are released, not leaked
    assert not any(c[0] == "publish" for c in client.calls)


def test_a_step_moves_logprobs_along_the_advantages(tiny_model_dir, tmp_path):
    samples = make_samples(n_groups=2, group_size=2, seed=4)
    client = FakeClient([samples])
    history = train(config(tiny_model_dir, tmp_path, lr=5e-3, max_grad_norm=None, behav_weight="off"), client=client)
    assert client.calls[-2:] == [("publish", "step_1", 6), ("ack", "L1")]
    _, advantages, _ = prepare_batch(samples, 5, config(tiny_model_dir, tmp_path))

    def mean_logprob(model_dir):
        policy = Policy(load_causal_lm(str(model_dir)))
        out = []
        for s in samples:
            with torch.no_grad():
                lp, _ = policy(torch.tensor([s["input_ids"]]), torch.ones(1, len(s["input_ids"]), dtype=torch.long),
                               torch.arange(len(s["input_ids"]))[None])
            m = torch.tensor(s["loss_mask"], dtype=torch.bool)
            out.append(lp[0][m].mean().item())
        return out

    before, after = mean_logprob(tiny_model_dir), mean_logprob(Path(history[0]["model_path"]))
    moved = [(b2 - b1) * a for b1, b2, a in zip(before, after, advantages) if a != 0]
    assert sum(moved) > 0 and sum(x > 0 for x in moved) >= len(moved) - 1


def test_prepare_batch_masks_missing_proximal_values(tiny_model_dir, tmp_path):
    s = make_samples(n_groups=1, group_size=1, seed=3)[0]
    s["proximal_versions"] = list(s["versions"])  # the v+1 recompute never happened
    s["proximal_logprobs_t"] = list(s["logprobs"])
    kept, _, info = prepare_batch([s], 5, config(tiny_model_dir, tmp_path, mask_missing_proximal=True))
    stale_tokens = sum(1 for m, v in zip(s["loss_mask"], s["versions"]) if m and v < 5)
    assert stale_tokens > 0
    assert info["missing_proximal_frac"] == pytest.approx(stale_tokens / sum(s["loss_mask"]))
    assert sum(kept[0]["loss_mask"]) == sum(s["loss_mask"]) - stale_tokens
    assert sum(s["loss_mask"]) > sum(kept[0]["loss_mask"])  # the input sample is not modified


def test_cli_flags(monkeypatch, tmp_path):
    monkeypatch.setenv("SPLICE_ADMIN_TOKEN", "from-env")
    cfg = config_from_argv([
        "--proxy", "http://a:1", "--proxy", "http://b:2", "--model", "/m", "--steps", "4", "--out", str(tmp_path),
        "--batch-samples", "16", "--lr", "2e-6", "--c-clip", "3", "--max-staleness", "none", "--no-publish",
        "--behav-weight", "decoupled", "--ppo-n-minibatches", "2",
    ])
    assert cfg.proxies == ["http://a:1", "http://b:2"] and cfg.steps == 4 and cfg.batch_samples == 16
    assert cfg.lr == 2e-6 and cfg.c_clip == 3.0 and cfg.max_staleness is None and cfg.publish is False
    assert cfg.admin_token == "from-env" and cfg.behav_weight == "decoupled" and cfg.ppo_n_minibatches == 2
    assert config_from_argv(["--proxy", "u", "--model", "m", "--admin-token", "x"]).admin_token == "x"
    monkeypatch.setenv("SPLICE_TRAIN_PROXIES", "http://c:3,http://d:4")
    monkeypatch.setenv("SPLICE_TRAIN_GRADIENT_CHECKPOINTING", "true")
    from_env = config_from_argv(["--model", "/m"])
    assert from_env.proxies == ["http://c:3", "http://d:4"] and from_env.gradient_checkpointing is True
    monkeypatch.delenv("SPLICE_TRAIN_PROXIES")
    with pytest.raises(ValueError, match="proxy"):
        main(["--model", "/m"])


def test_gradient_checkpointing_keeps_dropout_off_and_results_equal(tiny_model_dir, tmp_path):
    """Checkpointing needs train mode; dropout must still be off so the first ratio stays exactly 1."""
    import shutil

    model_dir = tmp_path / "with_dropout"
    shutil.copytree(tiny_model_dir, model_dir)
    cfg_json = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**cfg_json, "attention_dropout": 0.5}))

    weights = []
    for checkpointing in (False, True):
        client = FakeClient([make_samples(seed=8)])
        out = tmp_path / f"gc{checkpointing}"
        history = train(config(model_dir, out, gradient_checkpointing=checkpointing, ppo_n_minibatches=2), client=client)
        assert history[0]["first_minibatch_ratio_dev"] == 0.0
        weights.append(load_file(out / "step_1" / "model.safetensors"))
    for k in weights[0]:
        torch.testing.assert_close(weights[1][k], weights[0][k], atol=1e-6, rtol=1e-5)


def test_untrainable_samples_are_dropped():
    from trainer_bridge.train import drop_reason

    sample = {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "logprobs": [0.0, -0.1, -0.2], "versions": [-1, 0, 0],
              "proximal_logprobs_t": [0.0, -0.1, -0.2], "proximal_versions": [-1, 0, 0], "reward": 1.0}
    assert drop_reason(sample, 0, None) is None
    assert drop_reason({**sample, "trainable": False}, 0, None) == "untrainable"
