"""``--compile-layers`` (the CUDA default) on a Qwen2.5-VL policy: the language model's layer parts
compile; the vision blocks' attention loops over the images' ``cu_seqlens`` (a data-dependent
loop), so dynamo leaves that one frame eager instead of failing. The gradients of a step with
images equal the eager step's."""

from __future__ import annotations

import torch
from splice_trainer_testlib import SYNTHETIC_GUARDS_OFF
from test_vision import content_hash, png, vl_sample

from engines.reference.vision_files import ensure_vision_model
from trainer_bridge.config import TrainConfig
from trainer_bridge.distributed import Dist
from trainer_bridge.image_fetch import ImageSource
from trainer_bridge.learner import build_learner, learner_step
from trainer_bridge.train import prepare_batch

SIZES = [(150, 100), (90, 60)]


def _gradient_step(compile_layers: bool) -> dict[str, torch.Tensor]:
    """One step with SGD at lr 1: the weights move by exactly the gradient."""
    torch.manual_seed(0)
    cfg = TrainConfig(**SYNTHETIC_GUARDS_OFF, proxies=["unused"], model=str(ensure_vision_model()), progress=False,
                      micro_batch_tokens=64, ppo_n_minibatches=2, max_grad_norm=None, checkpoint_every=None,
                      gradient_checkpointing=True, compile_layers=compile_layers)
    learner = build_learner(cfg, Dist())
    before = {n: p.full_tensor().detach().clone() for n, p in learner.policy.named_parameters()}
    learner.optimizer = torch.optim.SGD(learner.policy.parameters(), lr=1.0)
    store = {content_hash(d): d for d in (png(*SIZES[0], 1), png(*SIZES[1], 2))}
    grids = {h: list(learner.vision.grid_for_size(*size)) for h, size in zip(store, SIZES)}
    hashes = list(store)
    samples = [vl_sample("a:0", [(hashes[0], grids[hashes[0]])], seed=1, reward=1.0),
               vl_sample("b:0", [(hashes[1], grids[hashes[1]])], seed=2, reward=0.0),
               vl_sample("c:0", [], seed=4, reward=0.2, n_out=30)]
    kept, advantages, _ = prepare_batch(samples, 5, cfg, learner.vision)
    ImageSource(learner.vision, store.__getitem__).attach(kept)
    learner_step(learner, kept, advantages, cfg, step=1, version=5)
    return {n: before[n] - p.full_tensor().detach() for n, p in learner.policy.named_parameters()}


def test_a_vision_policy_compiles_and_its_gradients_equal_eager():
    from torch._dynamo.utils import counters

    eager = _gradient_step(False)
    counters.clear()
    compiled = _gradient_step(True)
    assert counters["stats"]["unique_graphs"] > 0
    # every frame compiled but the vision attention's loop over images, which dynamo skips
    skipped = counters["frames"]["total"] - counters["frames"]["ok"]
    assert skipped <= 1, dict(counters["frames"])
    moved = [n for n in eager if eager[n].abs().max() > 0]
    assert any(".visual." in n for n in moved) and any(".language_model." in n or ".layers." in n for n in moved)
    worst = max((eager[n] - compiled[n]).norm().item() / max(eager[n].norm().item(), 1e-30) for n in moved)
    assert worst < 1e-3, worst  # fused float32 kernels round differently (4e-5 measured)
