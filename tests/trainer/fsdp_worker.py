"""Worker for test_fsdp.py: the same trainer work on one process or on two ranks under torchrun.

Launched either as a plain single process or under ``torchrun --nproc-per-node 2`` (gloo, CPU).
Writes ``rank{R}.pt`` with the gradients of every minibatch, the step stats and the histories,
and leaves the saved weights under OUT_DIR:

* ``grads``/``stats``: one learner step with a recording SGD (9 samples: uneven shares);
* ``train/``: one full train() step (rank 0 pulls, plans, sends each rank its share, saves);
* ``one_sample/``: a step whose minibatches each have fewer samples (1) than ranks;
* ``straight/``: two steps in one run; ``resumed/``: one step, then a new run resumed from its
  checkpoint for the second (same batches).

Usage: fsdp_worker.py MODEL_DIR OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from splice_trainer_testlib import SYNTHETIC_GUARDS_OFF, make_samples  # noqa: E402
from trainer_bridge import distributed  # noqa: E402
from trainer_bridge.config import TrainConfig  # noqa: E402
from trainer_bridge.train import build_learner, learner_step, prepare_batch, train  # noqa: E402


class RecordingSGD:
    """Plain SGD that keeps a full copy of every (sharded) gradient it steps with."""

    def __init__(self, params, lr):
        self.params, self.lr, self.grads = list(params), lr, []
        self.param_groups = [{"lr": lr}]

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        self.grads.append([p.grad.full_tensor().clone() for p in self.params])
        for p in self.params:
            p.add_(p.grad, alpha=-self.lr)


class FakeClient:
    """The ProxyClient methods train() uses; the version moves on publish like a proxy's."""

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


def main(model_dir: str, out_dir: str) -> None:
    torch.manual_seed(0)
    dist = distributed.setup("cpu")
    out = Path(out_dir)
    cfg = TrainConfig(**SYNTHETIC_GUARDS_OFF, proxies=["unused"], model=model_dir, out=str(out / "train"), micro_batch_tokens=48,
                      ppo_n_minibatches=2, max_grad_norm=None, c_clip=3.0, progress=False, keep_last=None,
                      checkpoint_every=None)
    samples = make_samples(n_groups=3, group_size=2, seed=7, max_len=30)  # 9 samples: uneven shares
    kept, advantages, _ = prepare_batch(samples, 5, cfg)

    learner = build_learner(cfg, dist)
    learner.optimizer = RecordingSGD(learner.policy.parameters(), lr=0.05)
    received = []  # the samples this rank was sent (its share), per scatter
    real_scatter = distributed.scatter

    def recording_scatter(d, per_rank):
        share = real_scatter(d, per_rank)
        received.append(sorted(s["sample_id"] for mb in share.minibatches for group, _ in mb for s in group))
        return share

    distributed.scatter = recording_scatter
    # only rank 0's samples are read: every other rank gets its share from rank 0
    stats = learner_step(learner, kept if dist.is_main else [], advantages if dist.is_main else [], cfg, step=1)
    distributed.scatter = real_scatter

    def client(batches, version=5):
        return FakeClient(batches, version) if dist.is_main else None

    def run(name, batches, version=5, **kw):
        return train(TrainConfig(**{**cfg.__dict__, "lr": 1e-3, "out": str(out / name), **kw}), client=client(batches, version))

    history = run("train", [samples])
    one = make_samples(n_groups=1, group_size=2, seed=11, max_len=30)  # 3 samples, 3 minibatches of one
    one_history = run("one_sample", [one], ppo_n_minibatches=3)

    second = make_samples(n_groups=2, group_size=2, seed=12, max_len=30, version=6)
    straight = run("straight", [samples, second], steps=2)
    run("resumed", [samples], steps=1, checkpoint_every=1)
    resumed = run("resumed", [second], version=6, steps=2, checkpoint_every=1,
                  resume=str(out / "resumed" / "checkpoints" / "step_1"))

    result = {"grads": learner.optimizer.grads, "stats": stats, "received": received[0], "history": history, "one_history": one_history,
              "straight": straight, "resumed": resumed}
    torch.save(result, out / f"rank{dist.rank}.pt")
    distributed.teardown(dist)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
