"""Weights over ``torch.distributed``: the engine side of SGLang's weight-update group.

SGLang's ``/init_weights_update_group`` makes the engine join a process group in which the
trainer is rank 0 (the sender) and the engine's ranks start at ``rank_offset``; each
``/update_weights_from_distributed`` then receives one ``broadcast`` from rank 0 per named
tensor, in the dtypes and shapes the request lists. The group is made the way SGLang makes it
(``sglang.srt.utils.common.init_custom_process_group``): a ``tcp://`` rendezvous on
``master_address:master_port``, a ``PrefixStore`` named after the group, and a process group of
its own (not the default group, so an engine can hold several and a trainer that never called
``init_process_group`` can join). A trainer that builds its side the same way talks to this
engine and to a real SGLang server alike.
"""

from __future__ import annotations

import datetime
import socket
import threading
import time

import torch

DEFAULT_TIMEOUT_S = 600.0


def init_custom_process_group(
    *, backend: str, master_address: str, master_port: int, world_size: int, rank: int, group_name: str, timeout_s: float
):
    """A process group of its own over a TCP rendezvous (SGLang's ``init_custom_process_group``)."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = datetime.timedelta(seconds=timeout_s)
    host = f"[{master_address}]" if ":" in master_address and not master_address.startswith("[") else master_address
    store, rank, world_size = next(rendezvous(f"tcp://{host}:{int(master_port)}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), store, group_name=group_name, backend_options=None, timeout=timeout
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


class JoinCancelled(RuntimeError):
    """The caller of ``/init_weights_update_group`` hung up before the trainer's store answered."""


def wait_for_master(host: str, port: int, *, timeout_s: float, cancelled: threading.Event | None, poll_s: float = 0.1) -> None:
    """Until ``host:port`` accepts a TCP connection (the trainer's rendezvous store is up).

    ``rendezvous`` itself retries connecting for its whole timeout and cannot be interrupted,
    so an engine asked to join an address it cannot reach would keep trying long after the
    proxy gave up; polling here first lets a hung-up caller stop the join within ``poll_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if cancelled is not None and cancelled.is_set():
            raise JoinCancelled(f"the join of {host}:{port} was abandoned by its caller")
        try:
            with socket.create_connection((host, port), timeout=max(poll_s, 0.05)):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise RuntimeError(f"the trainer's store at {host}:{port} did not answer within {timeout_s:g} s: {exc}") from exc
        time.sleep(poll_s)


class WeightGroups:
    """The weight-update groups this engine has joined, by name (thread-safe)."""

    def __init__(self, device: torch.device, *, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.device = device
        self.timeout_s = timeout_s
        self._groups: dict[str, object] = {}
        self._lock = threading.Lock()
        self.joined = 0  # groups joined since start (a debug counter: /model_info)
        self.joining = 0  # joins in progress (a debug counter: /model_info)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._groups)

    def join(
        self, *, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str,
        cancelled: threading.Event | None = None,
    ) -> None:  # fmt: skip
        """Join ``group_name`` as rank ``rank_offset`` (this engine has one rank). Blocks until
        every rank arrived. Raises ValueError for a bad request, RuntimeError when joining fails
        (:class:`JoinCancelled` when ``cancelled`` is set before the trainer's store answered)."""
        if not group_name:
            raise ValueError("Group name cannot be empty")
        if not 0 < int(rank_offset) < int(world_size):
            raise ValueError(f"rank_offset {rank_offset} must be in [1, world_size={world_size}): rank 0 is the trainer")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if backend == "nccl" and self.device.type != "cuda":
            raise ValueError("backend 'nccl' needs the model on a GPU; this engine runs on the CPU: use 'gloo'")
        with self._lock:
            if group_name in self._groups:
                raise ValueError(f"group {group_name!r} already exists; destroy it first")
        with self._lock:
            self.joining += 1
        try:
            start = time.monotonic()
            wait_for_master(master_address, int(master_port), timeout_s=self.timeout_s, cancelled=cancelled)
            pg = init_custom_process_group(
                backend=backend, master_address=master_address, master_port=int(master_port), world_size=int(world_size),
                rank=int(rank_offset), group_name=group_name, timeout_s=max(1.0, self.timeout_s - (time.monotonic() - start)),
            )  # fmt: skip
        finally:
            with self._lock:
                self.joining -= 1
        with self._lock:
            self._groups[group_name] = pg
            self.joined += 1

    def destroy(self, group_name: str) -> bool:
        with self._lock:
            pg = self._groups.pop(group_name, None)
        if pg is None:
            return False
        try:
            torch.distributed.destroy_process_group(pg)
        except Exception:  # noqa: BLE001 - a broken group is gone either way
            pass
        return True

    def receive(self, group_name: str, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> dict[str, torch.Tensor]:
        """One broadcast from rank 0 per tensor, in order. Every listed tensor is received even
        when the request is wrong for this model (the caller decides after), so the sender
        never waits on a broadcast nobody takes."""
        with self._lock:
            pg = self._groups.get(group_name)
        if pg is None:
            raise KeyError(f"Group {group_name} not in {self.names()}. Please call `init_weights_update_group` first.")
        out: dict[str, torch.Tensor] = {}
        for name, dtype, shape in zip(names, dtypes, shapes):
            t = torch.empty([int(s) for s in shape], dtype=getattr(torch, dtype), device=self.device)
            torch.distributed.broadcast(t, src=0, group=pg)
            out[name] = t
        return out


def parse_update(body: dict) -> tuple[list[str], list[str], list[list[int]]]:
    """``names``, ``dtypes``, ``shapes`` of an ``/update_weights_from_distributed`` body, checked."""
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
        raise ValueError("names, dtypes and shapes must be lists")
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(f"names ({len(names)}), dtypes ({len(dtypes)}) and shapes ({len(shapes)}) differ in length")
    for n, d, s in zip(names, dtypes, shapes):
        if not isinstance(n, str) or not n:
            raise ValueError(f"bad tensor name {n!r}")
        if not isinstance(d, str) or not isinstance(getattr(torch, d, None), torch.dtype):
            raise ValueError(f"unknown dtype {d!r} for {n}")
        if not isinstance(s, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in s):
            raise ValueError(f"bad shape {s!r} for {n}")
    return names, dtypes, shapes
