"""torch.distributed plumbing for running the trainer under ``torchrun``.

Rank 0 is the only rank that talks to the proxies: it pulls, then broadcasts the samples to every
rank; each rank trains on its shard and DDP all-reduces the gradients; rank 0 saves, publishes
and acks. Without ``WORLD_SIZE > 1`` everything here degrades to single-process no-ops.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as torch_dist


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    owns_group: bool = False  # setup() created the process group, so teardown() destroys it

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(preference: str = "auto", local_rank: int = 0) -> torch.device:
    if preference == "cpu" or (preference == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", local_rank)


def setup(device_preference: str = "auto", timeout_s: float = 3600.0) -> Dist:
    """Init the process group when launched by torchrun with several processes (nccl on CUDA, gloo on CPU)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_preference, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    owns_group = world_size > 1 and not torch_dist.is_initialized()
    if owns_group:
        backend = "nccl" if device.type == "cuda" else "gloo"
        # generous timeout: rank 0 may long-poll the proxy while the others wait in a broadcast
        torch_dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    return Dist(rank=rank, world_size=world_size, local_rank=local_rank, device=device, owns_group=owns_group)


def teardown(dist: Dist) -> None:
    if dist.owns_group and torch_dist.is_initialized():
        torch_dist.destroy_process_group()


def broadcast(dist: Dist, obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (a picklable Python object)."""
    if not dist.enabled:
        return obj
    box = [obj if dist.is_main else None]
    torch_dist.broadcast_object_list(box, src=0)
    return box[0]


class RemoteError(RuntimeError):
    """Raised on the other ranks when rank 0 failed in :func:`on_main`."""


def on_main(dist: Dist, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on rank 0 and hand its result to every rank.

    If it raises, every rank raises too (instead of the others hanging in the next collective).
    """
    if not dist.enabled:
        return fn()
    result, error = None, None
    if dist.is_main:
        try:
            result = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below, after telling the others
            error = e
    ok, payload = broadcast(dist, (error is None, result if error is None else repr(error)))
    if error is not None:
        raise error
    if not ok:
        raise RemoteError(f"rank 0 failed: {payload}")
    return payload


def gather(dist: Dist, obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    if not dist.enabled:
        return [obj]
    out: list[Any] = [None] * dist.world_size
    torch_dist.all_gather_object(out, obj)
    return out
