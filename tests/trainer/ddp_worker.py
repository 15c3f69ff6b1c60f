"""Worker for test_ddp.py: run one trainer step's gradient computation, and one full train() step.

Launched either as a plain single process or under ``torchrun --nproc_per_node 2`` (gloo, CPU).
Writes ``rank{R}.pt`` with the gradients of every minibatch, the step stats and the final weights.
Usage: ddp_worker.py MODEL_DIR OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from splice_trainer_testlib import make_samples  # noqa: E402
from trainer_bridge import distributed  # noqa: E402
from trainer_bridge.config import TrainConfig  # noqa: E402
from trainer_bridge.train import build_learner, learner_step, prepare_batch, train  # noqa: E402


class RecordingSGD:
    """Plain SGD that keeps a copy of every gradient it steps with."""

    def __init__(self, params, lr):
        self.params, self.lr, self.grads = list(params), lr, []
        self.param_groups = [{"lr": lr}]

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        self.grads.append([p.grad.clone() for p in self.params])
        for p in self.params:
            p.add_(p.grad, alpha=-self.lr)


class FakeClient:
    def __init__(self, samples):
        self.samples = samples

    def version(self):
        return 5

    def pull(self, max_samples, wait_s):
        samples, self.samples = self.samples, []
        return ("L", samples) if samples else (None, [])

    def ack(self, lease):
        pass

    def publish(self, path, version):
        pass


def main(model_dir: str, out_dir: str) -> None:
    torch.manual_seed(0)
    dist = distributed.setup("cpu")
    out = Path(out_dir)
    cfg = TrainConfig(proxies=["unused"], model=model_dir, out=str(out / "train"), micro_batch_tokens=48,
                      ppo_n_minibatches=2, max_grad_norm=None, c_clip=3.0, progress=False, keep_last=None)
    samples = make_samples(n_groups=3, group_size=2, seed=7, max_len=30)  # 9 samples: uneven shards
    kept, advantages, _ = prepare_batch(samples, 5, cfg)

    learner = build_learner(cfg, dist)
    learner.optimizer = RecordingSGD(learner.policy.parameters(), lr=0.05)
    stats = learner_step(learner, kept, advantages, cfg, step=1)

    # the whole loop: rank 0 pulls and broadcasts, every rank trains its shard, rank 0 saves
    client = FakeClient(samples) if dist.is_main else None
    history = train(TrainConfig(**{**cfg.__dict__, "lr": 1e-3}), client=client)

    result = {"grads": learner.optimizer.grads, "stats": stats, "history": history}
    torch.save(result, out / f"rank{dist.rank}.pt")
    distributed.teardown(dist)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
