"""A vision policy sharded over two FSDP2 ranks (torchrun, gloo, CPU) steps like one process.

The decoder layers and the vision blocks are each an FSDP unit; rank 0 alone fetches the images
and sends each rank its share with the image bytes. A rank whose micro-batch has no image (a
text sample, or a filler) still runs the vision tower on a dummy input, so both ranks run the
same collectives. Run as a script, this file is the worker: ``test_vision_fsdp.py OUT_DIR``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def worker(out_dir: str) -> None:
    sys.path.insert(0, str(HERE))
    from fsdp_worker import RecordingSGD
    from test_vision import content_hash, png, vl_sample

    from engines.reference.vision_files import ensure_vision_model
    from trainer_bridge import distributed
    from splice_trainer_testlib import SYNTHETIC_GUARDS_OFF
    from trainer_bridge.config import TrainConfig
    from trainer_bridge.image_fetch import ImageSource
    from trainer_bridge import learner as learner_module
    from trainer_bridge.learner import build_learner, learner_step
    from trainer_bridge.train import prepare_batch

    torch.manual_seed(0)
    model_dir = ensure_vision_model()
    dist = distributed.setup("cpu")
    cfg = TrainConfig(**SYNTHETIC_GUARDS_OFF, proxies=["unused"], model=str(model_dir), out=str(Path(out_dir) / "train"), progress=False,
                      micro_batch_tokens=64, ppo_n_minibatches=2, max_grad_norm=None, checkpoint_every=None)
    learner = build_learner(cfg, dist)
    learner.optimizer = RecordingSGD(learner.policy.parameters(), lr=0.05)
    store = {content_hash(d): d for d in (png(150, 100, 1), png(90, 60, 2), png(120, 120, 3))}
    hashes = list(store)
    grids = {h: list(learner.vision.grid_for_size(*size)) for h, size in zip(hashes, [(150, 100), (90, 60), (120, 120)])}
    samples = [vl_sample("a:0", [(hashes[0], grids[hashes[0]]), (hashes[1], grids[hashes[1]])], seed=1, reward=1.0),
               vl_sample("b:0", [(hashes[2], grids[hashes[2]])], seed=2, reward=0.0),
               vl_sample("c:0", [(hashes[1], grids[hashes[1]])], seed=3, reward=0.5),
               vl_sample("d:0", [], seed=4, reward=0.2, n_out=30)]  # text only
    kept, advantages = [], []
    if dist.is_main:
        kept, advantages, _ = prepare_batch(samples, 5, cfg, learner.vision)
        ImageSource(learner.vision, store.__getitem__).attach(kept)
    real_receive, layout = learner_module.receive_share, []

    def recording_receive(*args, **kw):  # which micro-batches of this rank carry images
        plans, plan_stats = real_receive(*args, **kw)
        layout.extend([[m.pixel_values is not None for m in plan.micro] for plan in plans])
        return plans, plan_stats

    learner_module.receive_share = recording_receive
    stats = learner_step(learner, kept, advantages, cfg, step=1, version=5)
    names = [k for k, _ in learner.policy.named_parameters()]
    torch.save({"grads": learner.optimizer.grads, "names": names, "stats": stats, "layout": layout},
               Path(out_dir) / f"rank{dist.rank}.pt")
    distributed.teardown(dist)


def test_two_ranks_match_one_process(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    outs = {}
    for name, launcher in [("one", [sys.executable]),
                           ("two", [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"])]:
        (tmp_path / name).mkdir()
        proc = subprocess.run([*launcher, __file__, str(tmp_path / name)], env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        outs[name] = [torch.load(p, weights_only=False) for p in sorted((tmp_path / name).glob("rank*.pt"))]
    (one,), (two0, two1) = outs["one"], outs["two"]
    # both ranks ran micro-batches with images, and at least one ran one without (text or filler)
    assert any(any(mb) for mb in two0["layout"]) and any(any(mb) for mb in two1["layout"])
    assert not all(all(mb) for mb in two0["layout"] + two1["layout"])
    assert len(one["grads"]) == len(two0["grads"]) == 2
    names = one["names"]
    for mb_one, mb0, mb1 in zip(one["grads"], two0["grads"], two1["grads"]):
        for name, g1, g20, g21 in zip(names, mb_one, mb0, mb1):
            assert torch.equal(g20, g21), name
            torch.testing.assert_close(g20, g1, atol=1e-6, rtol=1e-4, msg=name)
        vision = [g for name, g in zip(names, mb_one) if ".visual.blocks." in name]
        assert vision and all(torch.isfinite(g).all() for g in vision)
        assert any(g.abs().sum() > 0 for g in vision)
    for key in ("loss", "loss_tokens", "entropy_mean", "grad_norm"):
        assert abs(two0["stats"][key] - one["stats"][key]) <= 1e-5 + 1e-4 * abs(one["stats"][key]), key


if __name__ == "__main__":
    worker(sys.argv[1])
