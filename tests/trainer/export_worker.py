"""Build the sharded learner from a model folder and publish it (run alone or under torchrun).

Usage: python export_worker.py MODEL_DIR OUT_DIR  -> OUT_DIR/published (rank 0 writes)
"""

from __future__ import annotations

import sys

from trainer_bridge import distributed, export
from trainer_bridge.config import TrainConfig
from trainer_bridge.learner import build_learner


def main(model_dir: str, out_dir: str) -> None:
    dist = distributed.setup("cpu")
    config = TrainConfig(proxies=["unused"], model=model_dir, progress=False)
    learner = build_learner(config, dist)
    # small buckets: several files, so the bucket boundaries are exercised too
    export.save_engine_dir(learner.policy.model, dist, model_dir, f"{out_dir}/published", dtype="bfloat16",
                           bucket_mb=0.05)
    distributed.teardown(dist)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
