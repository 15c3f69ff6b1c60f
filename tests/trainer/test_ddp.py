"""Two processes under torchrun (gloo, CPU) compute the same gradients and weights as one."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

WORKER = Path(__file__).with_name("ddp_worker.py")
REPO = Path(__file__).resolve().parents[2]


def run(cmd, out: Path):
    out.mkdir(parents=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("ddp")
    (base / "one").mkdir()
    spec = importlib.util.spec_from_file_location("splice_ddp_worker", WORKER)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    worker.main(str(tiny_model_dir), str(base / "one"))  # the single-process reference, in this process
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(WORKER), str(tiny_model_dir), str(base / "two")], base / "two")
    load = lambda p: torch.load(p, weights_only=False)  # noqa: E731
    return base, load(base / "one" / "rank0.pt"), load(base / "two" / "rank0.pt"), load(base / "two" / "rank1.pt")


def test_gradients_match_single_process(runs):
    _, one, two0, two1 = runs
    assert len(one["grads"]) == len(two0["grads"]) == 2  # two minibatches
    for mb_one, mb_two0, mb_two1 in zip(one["grads"], two0["grads"], two1["grads"]):
        for g1, g20, g21 in zip(mb_one, mb_two0, mb_two1):
            assert torch.equal(g20, g21)  # all-reduced: identical on every rank
            torch.testing.assert_close(g20, g1, atol=1e-6, rtol=1e-4)
        assert any(g.abs().sum() > 0 for g in mb_one)


def test_stats_are_over_all_ranks(runs):
    _, one, two0, two1 = runs
    for key in ("loss", "loss_tokens", "behav_imp_weight_mean", "behav_imp_weight_std", "behav_imp_weight_max",
                "clip_frac", "entropy_mean", "grad_norm"):
        assert two0["stats"][key] == pytest.approx(one["stats"][key], rel=1e-4, abs=1e-6), key
        assert two1["stats"][key] == two0["stats"][key], key


def test_full_train_step_gives_the_same_weights(runs):
    base, one, two0, _ = runs
    w1 = load_file(base / "one" / "train" / "step_1" / "model.safetensors")
    w2 = load_file(base / "two" / "train" / "step_1" / "model.safetensors")
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], atol=1e-6, rtol=1e-5)
    assert one["history"][0]["n_samples"] == two0["history"][0]["n_samples"] == 9
