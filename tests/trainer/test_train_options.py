"""Trainer options for lab scale: dtype policy, activation checkpointing default, stale-token
masking, the skipped proximal pass, and what stats.jsonl records per step."""

from __future__ import annotations

import json

import pytest
import torch

from splice_trainer_testlib import make_samples
from trainer_bridge import learner as learner_mod
from trainer_bridge.config import TrainConfig, build_parser, config_from_argv
from trainer_bridge.distributed import Dist
from trainer_bridge.learner import activation_checkpointing, build_learner, compiled_layers, compute_dtype
from trainer_bridge.train import prepare_batch, train


def config(model, out, **kw) -> TrainConfig:
    base = dict(proxies=["http://unused"], model=str(model), out=str(out), steps=1, micro_batch_tokens=64, lr=1e-3,
                progress=False, checkpoint_every=None)
    base.update(kw)
    return TrainConfig(**base)


class Client:
    def __init__(self, batches, version=5):
        self.batches, self._version = list(batches), version

    def version(self):
        return self._version

    def pull(self, max_samples, wait_s):
        batch = self.batches.pop(0) if self.batches else []
        return ("L" if batch else None), batch

    def ack(self, lease):
        pass

    def publish(self, path, version):
        self._version = version


def test_bf16_adamw_is_refused_with_a_reason():
    with pytest.raises(ValueError, match="master copy"):
        config_from_argv(["--proxy", "http://a", "--model", "/m", "--model-dtype", "bfloat16"])
    assert config_from_argv(["--proxy", "http://a", "--model", "/m"]).model_dtype == "float32"
    with pytest.raises(ValueError, match="master copy"):  # also when built in code, not from the CLI
        build_learner(TrainConfig(proxies=["u"], model="/m", model_dtype="bfloat16"), Dist())


def test_precision_and_checkpointing_defaults_follow_the_device(monkeypatch):
    monkeypatch.setenv("CC", "cc")  # a C compiler for Triton, whatever this machine has (next test: none)
    cfg = TrainConfig(proxies=["u"], model="m")
    assert compute_dtype(cfg, torch.device("cuda", 0)) == torch.bfloat16
    assert compute_dtype(cfg, torch.device("cpu")) is None  # float32 on CPU
    assert activation_checkpointing(cfg, torch.device("cuda", 0)) is True
    assert activation_checkpointing(cfg, torch.device("cpu")) is False
    off = config_from_argv(["--proxy", "u", "--model", "m", "--no-gradient-checkpointing"])
    assert activation_checkpointing(off, torch.device("cuda", 0)) is False
    assert compiled_layers(cfg, torch.device("cuda", 0)) is True
    assert compiled_layers(cfg, torch.device("cpu")) is False
    eager = config_from_argv(["--proxy", "u", "--model", "m", "--no-compile-layers"])
    assert compiled_layers(eager, torch.device("cuda", 0)) is False
    assert compiled_layers(config_from_argv(["--proxy", "u", "--model", "m", "--compile-layers"]), torch.device("cpu"))


def test_without_a_c_compiler_the_cuda_default_is_eager_and_says_so(monkeypatch, capsys):
    """Triton needs a C compiler for its launchers; CUDA "runtime" images have none, and there the
    first compiled step would crash. The default turns eager, with a word; an explicit flag stands."""
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(learner_mod.shutil, "which", lambda name: None)
    learner_mod._say_no_compiler.cache_clear()
    cuda = torch.device("cuda", 0)
    assert compiled_layers(TrainConfig(proxies=["u"], model="m"), cuda) is False
    assert "no C compiler for Triton" in capsys.readouterr().err
    assert compiled_layers(TrainConfig(proxies=["u"], model="m", compile_layers=True), cuda) is True
    monkeypatch.setenv("CC", "/opt/cc")
    assert compiled_layers(TrainConfig(proxies=["u"], model="m"), cuda) is True


def test_help_states_the_defaults():
    text = build_parser().format_help()
    for needle in ("--missing-proximal", "fallback", "--loss-agg", "seq-mean-token-sum-norm", "--engine-gap-cap",
                   "--resume", "--micro-batch-tokens", "on with CUDA"):
        assert needle in text, needle


def test_stale_tokens_are_masked_not_the_sample():
    s = make_samples(n_groups=1, group_size=1, seed=3, version=5)[0]
    # an agent run over versions 1..5: its first loss tokens are too old for max_staleness 2
    loss_idx = [i for i, m in enumerate(s["loss_mask"]) if m]
    for j, i in enumerate(loss_idx):
        s["versions"][i] = 1 + (4 * j) // len(loss_idx)
        s["proximal_versions"][i] = s["versions"][i] + 1
    kept, _, info = prepare_batch([s], 6, config("m", "o", max_staleness=2))
    expected = [0 if (m and v < 4) else m for m, v in zip(s["loss_mask"], s["versions"])]
    assert len(kept) == 1 and kept[0]["loss_mask"] == expected
    assert info["n_stale_tokens_masked"] == sum(s["loss_mask"]) - sum(expected) > 0
    assert info["n_dropped_stale"] == 0
    all_old = dict(s, versions=[1 if m else -1 for m in s["loss_mask"]])
    kept, _, info = prepare_batch([all_old], 6, config("m", "o", max_staleness=2))
    assert kept == [] and info["n_dropped_stale"] == 1  # nothing left to learn from: dropped


def test_one_minibatch_skips_the_proximal_pass(tiny_model_dir, tmp_path, monkeypatch):
    calls = []
    real = learner_mod.proximal_pass
    monkeypatch.setattr(learner_mod, "proximal_pass", lambda *a, **k: calls.append(1) or real(*a, **k))
    samples = make_samples(seed=4)
    one = train(config(tiny_model_dir, tmp_path / "one", ppo_n_minibatches=1), client=Client([samples]))
    assert calls == [] and one[0]["proximal_pass_skipped"] is True and one[0]["first_minibatch_ratio_dev"] == 0.0
    assert one[0]["engine_gap_tokens"] > 0  # measured in the training forward instead
    two = train(config(tiny_model_dir, tmp_path / "two", ppo_n_minibatches=2), client=Client([samples]))
    assert calls == [1] and two[0]["proximal_pass_skipped"] is False


def test_stats_record_balance_padding_memory_and_staleness(tiny_model_dir, tmp_path):
    samples = make_samples(n_groups=3, group_size=2, seed=2)
    # synthetic behaviour log-probs are far from the model's: the mismatch guards would reweight them
    train(config(tiny_model_dir, tmp_path, ppo_n_minibatches=2, tis_cap=None, mis_low=None, mis_high=None),
          client=Client([samples]))
    record = json.loads((tmp_path / "stats.jsonl").read_text().splitlines()[0])
    assert record["imbalance"] == 1.0  # one rank
    # sdpa on CPU: rows as wide as the longest sample where that is cheaper; never more padding
    # than one row per sample
    assert 0.0 <= record["padding_frac"] <= record["padding_frac_unpacked"] and record["padding_frac_unpacked"] > 0
    assert record["peak_rss_mb_max"] > 50 and len(record["peak_rss_mb_by_rank"]) == 1
    # make_samples: tokens of versions 4 and 5 at version 5 -> staleness 1 and 0
    assert record["tokens_stale0"] + record["tokens_stale1"] == record["loss_tokens"]
    assert record["behav_imp_weight_mean_stale0"] == pytest.approx(1.0)  # fresh tokens: prox_t == behaviour
    assert record["behav_imp_weight_mean_stale1"] != pytest.approx(1.0)


def test_bf16_compute_keeps_float32_master_weights(tiny_model_dir):
    """FSDP mixed precision (what GPU runs use), here on CPU: the body runs in bfloat16 while the
    sharded parameters and AdamW state stay float32, and a step moves the weights."""
    from trainer_bridge.learner import learner_step

    cfg = TrainConfig(proxies=["u"], model=str(tiny_model_dir), compute_dtype="bfloat16", lr=1e-2, progress=False,
                      ppo_n_minibatches=2)
    kept, adv, _ = prepare_batch(make_samples(seed=1), 5, cfg)
    learner = build_learner(cfg, Dist())
    seen = []
    learner.policy.model.model.norm.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    before = {n: p.full_tensor().clone() for n, p in learner.policy.named_parameters()}
    stats = learner_step(learner, kept, adv, cfg, step=1, version=5)
    assert seen and set(seen) == {torch.bfloat16}
    assert {p.to_local().dtype for p in learner.policy.parameters()} == {torch.float32}
    moments = [v for s in learner.optimizer.state.values() for v in s.values() if v.dim()]
    assert moments and {v.dtype for v in moments} == {torch.float32}
    changed = [(p.full_tensor() != before[n]).float().mean().item() for n, p in learner.policy.named_parameters()]
    assert sum(changed) / len(changed) > 0.5
    assert stats["first_minibatch_ratio_dev"] == 0.0


def test_lr_warmup_scales_adamw_first_steps_and_then_stops():
    """``--lr-warmup-steps 2``: AdamW's first step is a sign step of size lr (bias correction),
    so with warm-up it moves each weight by exactly lr/3, the second by at most 2*lr/3 (a float64
    Adam by hand), and from the third on the full lr."""
    from trainer_bridge.learner import set_warmup_lr

    lr = 0.3
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.float64))
    opt = torch.optim.AdamW([w], lr=lr, weight_decay=0.0)
    seen = []
    for k, g in enumerate(([0.5, -4.0], [0.5, 1.0], [0.5, 1.0], [0.5, 1.0])):
        before = w.detach().clone()
        w.grad = torch.tensor(g, dtype=torch.float64)
        set_warmup_lr(opt, lr, 2)
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        if k == 0:  # first Adam step: -lr_k * g / |g| (eps 1e-8 aside)
            assert torch.allclose(w.detach() - before, -torch.tensor([1.0, -1.0], dtype=torch.float64) * lr / 3, atol=1e-9)
    assert seen == pytest.approx([lr / 3, 2 * lr / 3, lr, lr])
    set_warmup_lr(opt, lr, 0)  # off: the optimizer's lr is left alone
    assert opt.param_groups[0]["lr"] == pytest.approx(lr)


def test_lr_warmup_reaches_the_learner(tiny_model_dir, tmp_path):
    """Through ``train``: two minibatches per step and a 3-step warm-up: step 1's optimizer steps
    run at lr/4 and lr/2 (the stats record the last), step 2's at 3*lr/4 and lr."""
    samples = make_samples(seed=4)
    stats = train(config(tiny_model_dir, tmp_path, ppo_n_minibatches=2, lr_warmup_steps=3, lr=1e-3, steps=2),
                  client=Client([samples, make_samples(seed=5)]))
    assert [s["lr"] for s in stats] == pytest.approx([0.5e-3, 1e-3])


def test_compiled_layers_train_like_eager_and_stop_compiling(tiny_model_dir):
    """``--compile-layers`` with selective checkpointing (what a GPU run uses): the compiled parts
    really run (graphs are captured), a step moves the weights as the eager step does, and later
    steps with other micro-batch lengths compile nothing more (before, dynamo hit its limit of 8
    graphs and ran everything eagerly, silently)."""
    from torch._dynamo.utils import counters

    from trainer_bridge.learner import learner_step

    def step(compile_layers, seed, learner=None):
        cfg = TrainConfig(proxies=["u"], model=str(tiny_model_dir), lr=1e-2, progress=False, ppo_n_minibatches=2,
                          gradient_checkpointing=True, checkpoint_every_k_layers=2, compile_layers=compile_layers)
        kept, adv, _ = prepare_batch(make_samples(seed=seed), 5, cfg)
        learner = learner or build_learner(cfg, Dist())
        learner_step(learner, kept, adv, cfg, step=1, version=5)
        return learner, {n: p.full_tensor().detach().clone() for n, p in learner.policy.named_parameters()}

    _, eager = step(False, 1)
    counters.clear()
    compiled, after = step(True, 1)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0
    moved = max((eager[n] - after[n]).abs().max().item() for n in eager)
    assert moved < 1e-4, moved  # fused float32 kernels round differently; an update is ~1e-2 per weight
    lengths = set()
    for seed in (2, 3):
        lengths |= {len(s["input_ids"]) for s in make_samples(seed=seed)}
        step(True, seed, compiled)
    assert lengths - {len(s["input_ids"]) for s in make_samples(seed=1)}  # new lengths were seen
    assert counters["stats"]["unique_graphs"] == graphs
    # and none of it fell back to eager: every frame dynamo met compiled, no limit was hit
    assert counters["frames"]["total"] == counters["frames"]["ok"] > 0, dict(counters["frames"])
    assert not any("recompile" in k.lower() for k in counters["unimplemented"]), list(counters["unimplemented"])
