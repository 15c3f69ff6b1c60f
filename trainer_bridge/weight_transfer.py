"""The trainer's side of a weight transfer over ``torch.distributed`` (docs/weight_transfer.md).

The trainer is rank 0 of one process group per engine (the engine's ranks, one per GPU, from 1),
made the way SGLang makes its weight-update group (a ``tcp://`` rendezvous, a ``PrefixStore``
named after the group, a process group of its own), so no default process group is needed and
an FSDP2 trainer's own groups are untouched. Groups are kept across publishes
(:class:`WeightSender`) and re-made when the engine behind one changed.

Tensors go in buckets of at most ``bucket_bytes`` (a tensor larger than that is a bucket of its
own); only one bucket, plus the one tensor read ahead to know whether a bucket is the last, is
held at a time, so a trainer that materialises full tensors lazily (FSDP2
``DTensor.full_tensor()``) stays bounded by the bucket size.
"""

from __future__ import annotations

import datetime
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

DEFAULT_BUCKET_MB = 512.0


def default_backend() -> str:
    """``nccl`` where the trainer has a GPU, else ``gloo``."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def open_group(*, master_address: str, master_port: int, group_name: str, backend: str, world_size: int = 2, timeout_s: float = 600.0):
    """Rank 0 of a process group of its own (SGLang's ``init_custom_process_group``): hosts the
    rendezvous store and returns once every rank joined."""
    from torch.distributed import TCPStore
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    timeout = datetime.timedelta(seconds=timeout_s)
    # The store is made here, not through ``rendezvous("tcp://...")``: under torchrun that helper
    # connects to the elastic agent's store as a client (TORCHELASTIC_USE_AGENT_STORE) and
    # nobody would host this group's store, so rank 0 would wait out the timeout.
    store = TCPStore(master_address, int(master_port), world_size, is_master=True, timeout=timeout, wait_for_workers=False)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, 0, [], Backend(backend), store, group_name=group_name, backend_options=None, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (what the engines' requests carry)."""
    return str(dtype).split(".")[-1]


@dataclass
class Bucket:
    """Named tensors sent together (one update call per engine)."""

    tensors: list[tuple[str, torch.Tensor]]
    first: bool
    final: bool

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self.tensors]

    @property
    def dtypes(self) -> list[str]:
        return [dtype_name(t.dtype) for _, t in self.tensors]

    @property
    def shapes(self) -> list[list[int]]:
        return [list(t.shape) for _, t in self.tensors]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for _, t in self.tensors)


def buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, *, dtype: torch.dtype | None = None) -> Iterator[Bucket]:
    """Group ``(name, tensor)`` pairs into buckets of at most ``bucket_bytes`` (in the order
    given; ``dtype``: cast to the engine's dtype first). Reads one tensor ahead, so the last
    bucket is known to be the last when it is yielded."""
    it = iter(named)
    held: tuple[str, torch.Tensor] | None = None
    first = True

    def prep(item: tuple[str, torch.Tensor]) -> tuple[str, torch.Tensor]:
        name, t = item
        t = t.detach()
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
        return name, t.contiguous()

    nxt = next(it, None)
    held = prep(nxt) if nxt is not None else None
    if held is None:
        return
    while held is not None:
        cur, size = [held], held[1].numel() * held[1].element_size()
        held = None
        for item in it:
            item = prep(item)
            n = item[1].numel() * item[1].element_size()
            if size + n > bucket_bytes:
                held = item
                break
            cur.append(item)
            size += n
        yield Bucket(cur, first=first, final=held is None)
        first = False


@dataclass
class EngineLink:
    """The trainer's group with one engine. ``key``: what the group was made against (the
    proxy that drives the engine and the engine's epoch there); another key re-makes it."""

    engine: str
    group_name: str
    pg: object
    key: tuple
    backend: str
    made_at: float = field(default_factory=time.time)


class TransferError(RuntimeError):
    """A broadcast to one engine failed or was abandoned (its update call failed)."""


class WeightSender:
    """Rank 0 of one group per engine, kept across publishes.

    ``master_address``: the address the engines reach the trainer at (loopback for a single
    machine). ``backend``: ``gloo`` (CPU tensors) or ``nccl`` (GPU tensors; default where the
    trainer has a GPU). ``timeout_s`` bounds joining and each broadcast.
    """

    def __init__(self, *, master_address: str = "127.0.0.1", backend: str | None = None, timeout_s: float = 600.0):
        self.master_address = master_address
        self.backend = backend or default_backend()
        self.timeout_s = float(timeout_s)
        self.links: dict[str, EngineLink] = {}
        self.groups_made = 0

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def link(self, engine: str, key: tuple, join: Callable[[dict], Future], *, ranks: int = 1) -> tuple[EngineLink, bool]:
        """The group with ``engine``: the kept one when its key matches, else a new one, in
        which the engine's ``ranks`` (its GPUs) take ranks 1..ranks.
        ``join(body)`` starts the engine's join (the proxy's ``/admin/weights/init_group``
        body without ``engine``) and returns its future; rank 0 joins meanwhile. Returns
        ``(link, made_now)``."""
        old = self.links.get(engine)
        if old is not None and old.key == key:
            return old, False
        if old is not None:
            self.drop(engine)
        port = free_port(self.master_address)
        name = f"splice-weights-{uuid.uuid4().hex[:12]}"
        world = 1 + max(1, int(ranks))
        body = {"master_address": self.master_address, "master_port": port, "group_name": name, "backend": self.backend, "rank_offset": 1, "world_size": world}
        fut = join(body)
        made: dict[str, object] = {}

        def rank0() -> None:
            try:
                made["pg"] = open_group(master_address=self.master_address, master_port=port, group_name=name, backend=self.backend, world_size=world, timeout_s=self.timeout_s)
            except BaseException as exc:  # noqa: BLE001 - reported below
                made["error"] = exc

        th = threading.Thread(target=rank0, name=f"splice-rank0-{name}", daemon=True)
        th.start()
        deadline = time.monotonic() + self.timeout_s
        while th.is_alive():
            if fut.done() and fut.exception() is not None:  # the engine will not join: stop waiting
                raise TransferError(f"the engine could not join the weight-update group: {fut.exception()}")
            if time.monotonic() > deadline:
                raise TransferError(f"the engine did not join the weight-update group within {self.timeout_s:.0f}s")
            th.join(0.01)
        if "error" in made:
            if fut.done() and fut.exception() is not None:
                raise TransferError(f"the engine could not join the weight-update group: {fut.exception()}")
            raise TransferError(f"opening the weight-update group failed: {made['error']}") from made["error"]  # type: ignore[misc]
        pg = made["pg"]
        try:
            fut.result(timeout=self.timeout_s)  # the engine's error, if it failed after rank 0 joined
        except Exception as exc:
            try:
                dist.destroy_process_group(pg)
            except Exception:  # noqa: BLE001
                pass
            raise TransferError(f"the engine could not join the weight-update group: {exc}") from exc
        link = EngineLink(engine, name, pg, key, self.backend)
        self.links[engine] = link
        self.groups_made += 1
        return link, True

    def drop(self, engine: str) -> EngineLink | None:
        """Forget the group with ``engine`` (after a failure, or when it was re-made)."""
        link = self.links.pop(engine, None)
        if link is not None:
            try:
                dist.destroy_process_group(link.pg)
            except Exception:  # noqa: BLE001 - a broken group is gone either way
                pass
        return link

    def send(self, link: EngineLink, bucket: Bucket, call: Future) -> None:
        """Broadcast ``bucket`` over ``link`` while ``call`` (the engine's update request) runs;
        stop as soon as the call failed, so a rejected bucket never leaves rank 0 waiting for a
        receiver that will not come. Raises :class:`TransferError`."""
        deadline = time.monotonic() + self.timeout_s
        for name, t in bucket.tensors:
            if t.device != self.device:
                t = t.to(self.device)
            work = dist.broadcast(t, src=0, group=link.pg, async_op=True)
            spins = 0
            while not work.is_completed():
                if call.done() and call.exception() is not None:
                    raise TransferError(f"the engine's update call failed while {name} was being sent: {call.exception()}")
                if time.monotonic() > deadline:
                    raise TransferError(f"broadcasting {name} took more than {self.timeout_s:.0f}s")
                spins += 1
                time.sleep(0 if spins < 100 else 0.001)
            try:
                work.wait()
            except Exception as exc:  # noqa: BLE001 - the peer went away
                raise TransferError(f"broadcasting {name} failed: {exc}") from exc

    def close(self, destroy: Callable[[EngineLink], None] | None = None) -> None:
        """Drop every group; ``destroy(link)`` also tells the engine (best effort)."""
        for engine in list(self.links):
            link = self.drop(engine)
            if destroy is not None and link is not None:
                try:
                    destroy(link)
                except Exception:  # noqa: BLE001 - best effort at shutdown
                    pass


def safetensors_tensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of every ``*.safetensors`` file in ``folder``, one at a time (memory stays
    bounded by a bucket), in file then key order."""
    from pathlib import Path

    from safetensors import safe_open

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder!r}")
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for key in fh.keys():
                yield key, fh.get_tensor(key)


# -- what a trainer loop calls ---------------------------------------------------------------


def full_tensors(model: torch.nn.Module, *, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` for every parameter of ``model`` under the names the engines load
    (an HF model's own names; a tied head is sent once, as the embedding), one at a time.

    A sharded parameter (FSDP2's ``DTensor``) is gathered with ``full_tensor()``, which is a
    collective: every rank must iterate this to the end in the same order, and only rank 0
    sends. ``dtype``: the engine's dtype (cast as each tensor is produced, so memory stays
    bounded by a bucket)."""
    from .export import engine_tensors  # each shard cast on its device before the gather

    params = {name for name, _ in model.named_parameters()}
    for name, t in engine_tensors(model, dtype):
        if name in params:
            yield name, t


def choose_transfer(statuses: list[dict], requested: str = "auto") -> str:
    """``distributed`` or ``disk``. ``auto``: distributed when every proxy's engines speak
    SGLang's weight-update API (SGLang, the reference engine); vLLM's is NCCL-only and needs
    vLLM's own communicator on the trainer, so a fleet with vLLM engines uses the disk."""
    if requested in ("distributed", "disk"):
        return requested
    if requested != "auto":
        raise ValueError(f"weight transfer must be auto, distributed or disk, got {requested!r}")
    kinds = {str((st.get("engines") or {}).get("kind") or "") for st in statuses}
    return "distributed" if kinds == {"sglang"} else "disk"


class TrainerPublisher:
    """The distributed transfer as a trainer loop uses it (rank 0): one :class:`WeightSender`
    kept across steps, so each engine joins once; ``close()`` also tells the engines to drop
    their groups."""

    def __init__(self, client, *, bucket_mb: float | None = None, master_address: str = "127.0.0.1", backend: str | None = None,
                 dtype: torch.dtype | None = None, timeout_s: float = 600.0):  # fmt: skip
        self.client = client
        self.bucket_mb = bucket_mb
        self.dtype = dtype
        self.sender = WeightSender(master_address=master_address, backend=backend, timeout_s=timeout_s)

    def publish(self, model: torch.nn.Module, version: int):
        """Broadcast ``model``'s weights as ``version`` through the fleet protocol; returns the
        ``PublishReport`` (raises ``PublishError`` as ``publish_tensors`` does)."""
        return self.publish_named(full_tensors(model, dtype=self.dtype), version)

    def publish_named(self, named: Iterable[tuple[str, torch.Tensor]], version: int):
        """The same from ``(name, tensor)`` pairs (a sharded trainer's gathered full tensors)."""
        from .publish import publish_tensors

        return publish_tensors(self.client.urls, named, version, sender=self.sender, client=self.client, bucket_mb=self.bucket_mb)

    def close(self) -> None:
        from .publish import destroy_groups

        destroy_groups(self.sender, self.client)


def resolve_transfer(client, requested: str = "auto") -> str:
    """:func:`choose_transfer` over every proxy's ``/admin/status`` (rank 0; the statuses the
    client last read, e.g. for ``version()``, when it has them)."""
    if requested in ("distributed", "disk"):
        return requested
    if not hasattr(client, "statuses"):
        return "disk"  # a client that only knows the disk publish
    statuses = getattr(client, "last_statuses", None) or client.statuses()
    return choose_transfer(statuses, requested)
