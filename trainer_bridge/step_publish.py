"""Publishing a training step, behind one seam (:class:`StepPublisher`).

Every rank hands its shards over; rank 0 saves ``<out>/step_{k}`` (safetensors + tokenizer files)
and publishes it to the proxies as the next version (the fleet protocol, ``trainer_bridge.publish``),
or broadcasts the weights straight from the shards (``weight_transfer``, no directory but the
last step's), then acks the step's leases and prunes old step directories.
``trainer_bridge.train`` re-exports these names.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from . import distributed, export
from .client import ProxyError
from .config import TrainConfig
from .learner import Learner
from .policy import save_hf_dir
from .weight_transfer import TrainerPublisher, full_tensors


_STEP_DIR = re.compile(r"^step_(\d+)$")


def prune_step_dirs(out: Path, keep_last: int | None) -> None:
    if keep_last is None:
        return
    steps = sorted(
        (int(m.group(1)), p) for p in out.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))
    )
    for _, path in steps[: max(0, len(steps) - keep_last)]:
        shutil.rmtree(path, ignore_errors=True)


def ack_lease(client: Any, lease: str) -> None:
    """Ack, tolerating a lease the proxy already took back (it timed out during a long step)."""
    try:
        client.ack(lease)
    except ProxyError as e:
        if e.status not in (404, 409):
            raise
        print(f"warning: lease {lease} could not be acked ({e.message}); its samples may be served again", file=sys.stderr)


def full_state_dict(learner: Learner) -> dict[str, torch.Tensor]:
    """Collective: the whole model's weights gathered from the shards, on rank 0's CPU (empty elsewhere)."""
    sd = get_model_state_dict(learner.policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    prefix = "model."
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in sd.items()}


def publish_dir(learner: Learner, config: TrainConfig, path: Path, engine_dtype: str | None) -> None:
    """Collective: write the step's weights to ``path`` (rank 0). A text model goes through
    ``export.save_engine_dir`` (engine dtype on device, bucket by bucket, a tied head once); a
    vision model through transformers' ``save_pretrained`` (its checkpoint key conversion)."""
    if learner.vision is None:
        export.save_engine_dir(learner.policy.model, learner.dist, config.model, path, dtype=engine_dtype,
                               bucket_mb=config.export_bucket_mb)
        return
    weights = full_state_dict(learner)
    distributed.on_main(learner.dist, lambda: save_hf_dir(learner.policy.model, config.model, path, dtype=engine_dtype,
                                                          state_dict=weights))


class StepPublisher:
    """Collective: a step's weights out to the engines and its leases acked (rank 0 talks to the
    proxies). ``transfer``: ``disk`` (a step directory each step) or ``distributed`` (one
    :class:`TrainerPublisher` kept across steps, so each engine joins once; ``close()`` ends it)."""

    def __init__(self, client: Any, config: TrainConfig, learner: Learner, out: Path, transfer: str, engine_dtype: str | None):
        self.client = client
        self.config = config
        self.learner = learner
        self.out = out
        self.transfer = transfer
        self.engine_dtype = engine_dtype
        self.publisher: TrainerPublisher | None = None

    def publish(self, step: int, new_version: int, leases: list[str]) -> Path:
        """Publish the learner's weights as ``new_version`` (when ``config.publish``) and ack
        ``leases``; returns the step's directory (written unless a broadcast needs none)."""
        config, learner, client = self.config, self.learner, self.client
        path = self.out / f"step_{step}"
        streamed = config.publish and self.transfer == "distributed"
        # A broadcast publish needs no directory: each tensor is gathered from the shards as
        # its bucket is sent (memory bounded by a bucket). The last step is still saved.
        save_dir = not streamed or step == config.steps
        # -- weights out (export.py): gathered in the engine dtype, rank 0 writes bucket by bucket
        if save_dir:
            publish_dir(learner, config, path, self.engine_dtype)
        dtype = getattr(torch, self.engine_dtype) if self.engine_dtype else None
        # Collective on every rank: all of them gather each tensor, rank 0 alone sends it.
        named = full_tensors(learner.policy.model, dtype=dtype) if streamed else iter(())

        def publish() -> None:
            if streamed:  # docs/weight_transfer.md
                if self.publisher is None:
                    self.publisher = TrainerPublisher(client, bucket_mb=config.bucket_mb, master_address=config.master_address, dtype=dtype)
                try:
                    self.publisher.publish_named(named, new_version)
                finally:
                    for _ in named:  # the other ranks gather every tensor: so does rank 0
                        pass
            elif config.publish:
                client.publish(str(path), new_version)
            for lease in leases:  # trained on (or dropped as too stale): done with them
                ack_lease(client, lease)
            prune_step_dirs(self.out, config.keep_last)

        if not learner.dist.is_main:
            for _ in named:  # rank 0 gathers the same tensors while it sends them
                pass
        distributed.on_main(learner.dist, publish)
        return path

    def close(self) -> None:
        """Tell the engines to drop their weight-update groups (a distributed transfer's)."""
        if self.publisher is not None:
            self.publisher.close()
