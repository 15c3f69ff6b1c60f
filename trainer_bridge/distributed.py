"""torch.distributed plumbing for running the trainer under ``torchrun``.

Rank 0 is the only rank that talks to the proxies: it pulls, plans the step and sends each rank
only its share of the samples; each rank trains on its share of the FSDP2-sharded model; rank 0
saves, publishes and acks. A single process gets a one-rank process group too, so the sharded
code path is the same for every world size; the object collectives below skip the wire there.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import sys
import tempfile
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
    if world_size > 1 and not faulthandler.is_enabled():
        # a native abort in one rank (gloo, NCCL, a C++ assert) then prints every thread's Python
        # stack in that rank's log, not only torchrun's bare "Signal 6 (SIGABRT)"
        faulthandler.enable()
    owns_group = not torch_dist.is_initialized()
    if owns_group:
        backend = "nccl" if device.type == "cuda" else "gloo"
        # generous timeout: rank 0 may long-poll the proxy while the others wait in a broadcast
        timeout = timedelta(seconds=timeout_s)
        if world_size > 1:
            torch_dist.init_process_group(backend=backend, timeout=timeout)
        else:
            _single_process_group(backend, timeout)
    return Dist(rank=rank, world_size=world_size, local_rank=local_rank, device=device, owns_group=owns_group)


def _single_process_group(backend: str, timeout: timedelta) -> None:
    """A one-rank group over a private file store (no port to pick, nothing to clean up)."""
    fd, path = tempfile.mkstemp(prefix="splice-train-pg-")
    os.close(fd)
    os.unlink(path)  # FileStore creates it
    store = torch_dist.FileStore(path, 1)
    torch_dist.init_process_group(backend=backend, store=store, rank=0, world_size=1, timeout=timeout)
    _STORE_FILES.append(path)


_STORE_FILES: list[str] = []
_LAST_WORK: list[Any] = []  # see teardown(): freed by the main thread, never by gloo's


@atexit.register
def _remove_store_files() -> None:
    while _STORE_FILES:
        try:
            os.unlink(_STORE_FILES.pop())
        except OSError:
            pass


def ensure_group(dist: Dist) -> None:
    """Make sure a process group exists (a :class:`Dist` built by hand, as in tests, has none)."""
    if not torch_dist.is_initialized():
        if dist.world_size > 1:
            raise RuntimeError("a multi-rank Dist needs setup() under torchrun")
        _single_process_group("nccl" if dist.device.type == "cuda" else "gloo", timedelta(seconds=3600))


def teardown(dist: Dist) -> None:
    """Destroy the process group ``setup`` made. On a clean exit the ranks meet at a barrier
    first, so no rank closes its connections while another (rank 0 still writing files) is yet
    to use them. While an exception unwinds there is no barrier: the other ranks may be inside
    a collective, and waiting on them would turn a crash into a hang.

    The barrier's work object is kept until the interpreter exits. Otherwise gloo's worker
    thread may drop the last reference to it after this function has returned; freeing it
    needs the GIL (it holds a tensor with a Python object), and a thread asking for the GIL
    while the interpreter finalizes is ended by a forced unwind, which aborts the process with
    "terminate called without an active exception" (about one two-rank exit in 50 on a loaded
    machine, after all work was done)."""
    if dist.owns_group and torch_dist.is_initialized():
        if dist.world_size > 1 and sys.exc_info()[0] is None:
            work = torch_dist.barrier(async_op=True)
            work.wait()
            _LAST_WORK[:] = [work]
        torch_dist.destroy_process_group()
        _remove_store_files()


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


def scatter(dist: Dist, per_rank: list[Any] | None) -> Any:
    """Rank 0's ``per_rank[r]`` on rank ``r``: each rank receives only its own share."""
    if not dist.enabled:
        return per_rank[0]
    out: list[Any] = [None]
    torch_dist.scatter_object_list(out, per_rank if dist.is_main else None, src=0)
    return out[0]


def gather(dist: Dist, obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank."""
    if not dist.enabled:
        return [obj]
    out: list[Any] = [None] * dist.world_size
    torch_dist.all_gather_object(out, obj)
    return out
