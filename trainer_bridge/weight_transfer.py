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

:func:`publish_tensors` runs the fleet protocol (``trainer_bridge.fleet``) with this broadcast in
place of the load from disk; ``trainer_bridge.publish`` re-exports it without importing torch.
"""

from __future__ import annotations

import datetime
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .client import ProxyClient
from .fleet import (
    Laps,
    PublishError,
    PublishReport,
    engine_replicas,
    error_message,
    parallel,
    plan_loads,
    recompute_then_pause,
    resume_all,
    resume_and_time,
)

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


# -- the fleet protocol with the weights broadcast (``trainer_bridge.publish`` re-exports these) ----------------------------------------------------------


def publish_tensors(
    proxies: str | Sequence[str],
    named_tensors: Iterable[tuple[str, Any]],
    version: int,
    admin_token: str | None = None,
    *,
    sender: Any = None,
    bucket_mb: float | None = None,
    dtype: Any = None,
    master_address: str = "127.0.0.1",
    backend: str | None = None,
    client: ProxyClient | None = None,
    timeout_s: float = 600.0,
    before_resume: Callable[[str], None] | None = None,
) -> PublishReport:
    """The fleet protocol with the weights broadcast from this process (rank 0) instead of read
    from a path (docs/weight_transfer.md). Needs torch (this module).

    ``named_tensors``: ``(name, tensor)`` pairs in the engine's parameter names, produced lazily
    (``model.named_parameters()``, or an FSDP2 trainer's per-bucket ``full_tensor()`` gather);
    they are iterated exactly once, to the end, even when every engine failed (a sharded
    trainer's other ranks run the same gathers). ``sender``: a
    :class:`WeightSender` kept across publishes so each engine
    joins once (made here and closed at the end when None). ``bucket_mb``: tensors per update
    call; ``dtype``: cast to the engine's dtype (None: as given).

    Steps: status; owed recomputes then pause on every proxy; every proxy takes the engines
    about to change out of rotation; each engine (through one proxy) joins its group with rank 0
    unless it still holds one; per bucket, each engine's proxy issues the update call while this
    process broadcasts; every proxy learns the version and which engines completed; every proxy
    resumes. An engine whose transfer failed stays out of rotation (named in ``/admin/status``
    ``out_of_rotation``) until a later complete publish, the others go on, and
    :class:`PublishError` (step ``transfer``) names it after every proxy resumed. Engines that
    already report ``version`` are skipped.
    """
    own_sender = sender is None
    if sender is None:
        sender = WeightSender(master_address=master_address, backend=backend, timeout_s=timeout_s)
    own = client is None
    if client is None:
        client = ProxyClient(proxies, admin_token=admin_token, timeout_s=timeout_s, max_retries=2, backoff_s=0.2)
    # transfer calls are never retried: a repeated join or bucket would wait for a broadcast that already went
    xfer = ProxyClient(client.urls, admin_token=admin_token or getattr(client, "admin_token", None), timeout_s=timeout_s, max_retries=0)
    it = iter(named_tensors)
    try:
        return _publish_tensors(client, xfer, sender, it, int(version), bucket_mb, dtype, before_resume)
    except BaseException:
        try:  # whatever failed, the tensors are read to the end: other ranks gather them too
            for _ in it:
                pass
        except Exception:  # noqa: BLE001 - the original error wins
            pass
        raise
    finally:
        if own_sender:
            sender.close(lambda link: _destroy_remote(xfer, link))
        xfer.close()
        if own:
            client.close()


def destroy_groups(sender: Any, client: ProxyClient) -> None:
    """Drop every group ``sender`` holds, telling each engine through its proxy (best effort)."""
    xfer = ProxyClient(client.urls, admin_token=getattr(client, "admin_token", None), timeout_s=30.0, max_retries=0)
    try:
        sender.close(lambda link: _destroy_remote(xfer, link))
    finally:
        xfer.close()


def _destroy_remote(xfer: ProxyClient, link: Any) -> None:
    i, _epoch = link.key
    xfer.admin(i, "/admin/weights/destroy_group", {"engine": link.engine, "group_name": link.group_name})


def _publish_tensors(client, xfer, sender, named_tensors, version, bucket_mb, dtype, before_resume) -> PublishReport:
    urls = list(client.urls)
    every = list(range(len(urls)))
    report = PublishReport(version=version, model_path="", proxies=urls, transfer="distributed")
    lap = Laps(report)

    def fail_first(step: str, results) -> None:
        bad = [(i, exc) for i, _, exc in results if exc is not None]
        if bad:
            i, exc = bad[0]
            raise PublishError(step, urls[i], error_message(exc), report, cause=exc)

    # 1. the engines, which proxy drives each, and what each reports
    results = parallel(lambda i: client.status(i), every)
    fail_first("status", results)
    statuses = [res if isinstance(res, dict) else {} for _, res, _ in results]
    engines, assigned = plan_loads(statuses)
    if not engines:
        raise PublishError("status", urls[0], "no proxy lists its engines (engines.engine_replicas): the distributed transfer needs them", report)
    vllm = [urls[i] for i, st in enumerate(statuses) if (st.get("engines") or {}).get("kind") == "vllm"]
    if vllm:  # its workers join vLLM's own NCCL communicator, not this kind of group: they would wait forever
        raise PublishError("status", vllm[0], "vLLM engines receive weights only from vLLM's own NCCL communicator "
                           "(vllm.distributed.weight_transfer); publish to them from disk (--model-path)", report)
    report.engines = engines
    report.loaders = {e: urls[i] for e, i in assigned.items()}
    facts = {e: next(r for r in engine_replicas(statuses[assigned[e]]) if str(r["id"]) == e) for e in engines}
    todo = []
    for e in engines:
        f = facts[e]
        if f.get("weight_version") == version and not f.get("out_of_rotation") and f.get("healthy", True):
            report.skipped.append(e)
        else:  # one its proxy last saw down is tried too: it may be back (joining fails fast if not)
            todo.append(e)
    lap("status")

    groups_before = sender.groups_made
    try:
        # 2. owed recomputes on every proxy, then (only then) every proxy pauses
        results = recompute_then_pause(client, every, urls, report)
        fail_first("pause", results)
        lap("pause")

        # 3. every proxy takes the engines about to change out of rotation (a transfer that
        #    stops half way then leaves none of them serving mixed weights)
        changing = todo + list(report.failed)
        results = parallel(lambda i: client.admin(i, "/admin/weights/begin", {"version": version, "engines": changing}), every)
        fail_first("begin", results)

        # 4. each engine joins its group with rank 0 once (kept while the engine stays the same)
        links: dict[str, Any] = {}
        kept: set[str] = set()  # engines whose group was made by an earlier publish
        pool = ThreadPoolExecutor(max_workers=max(4, 2 * len(todo)))
        try:
            def connect(k: int) -> None:
                e = todo[k]
                i = assigned[e]
                key = (i, facts[e].get("epoch", 0))
                join = lambda body: pool.submit(xfer.admin, i, "/admin/weights/init_group", {**body, "engine": e})  # noqa: E731
                ranks = int((xfer.admin(i, "/admin/weights/ranks", {"engine": e}) or {}).get("ranks") or 1)
                links[e], made = sender.link(e, key, join, ranks=ranks)
                if not made:
                    kept.add(e)

            for k, _, exc in parallel(connect, list(range(len(todo)))):
                if exc is not None:
                    report.failed[todo[k]] = f"joining the weight-update group failed: {error_message(exc)}"
                    sender.drop(todo[k])
            report.groups_made = sender.groups_made - groups_before
            lap("connect")

            # 5. per bucket: each engine's proxy issues the update call while rank 0 broadcasts
            mb = DEFAULT_BUCKET_MB if bucket_mb is None else float(bucket_mb)
            for bucket in buckets(named_tensors, max(1, int(mb * 2**20)), dtype=dtype):
                report.buckets += 1
                active = [e for e in todo if e not in report.failed]
                if not active:
                    continue  # every engine failed: the rest is read (other ranks gather too), not sent
                report.bytes_sent += bucket.nbytes

                def send(k: int, bucket=bucket, active=active) -> None:
                    e = active[k]
                    body = {
                        "engine": e, "group_name": links[e].group_name, "version": version,
                        "names": bucket.names, "dtypes": bucket.dtypes, "shapes": bucket.shapes,
                        "first": bucket.first, "final": bucket.final,
                    }  # fmt: skip
                    call = pool.submit(xfer.admin, assigned[e], "/admin/weights/update", body)
                    try:
                        sender.send(links[e], bucket, call)
                        call.result(timeout=sender.timeout_s)
                    except Exception:
                        if not (bucket.first and e in kept):
                            raise
                        # a kept group that no longer works (the engine restarted between two
                        # health checks, so its proxy saw no change): make a new one, once
                        kept.discard(e)
                        old = sender.drop(e)
                        if old is not None:
                            try:
                                _destroy_remote(xfer, old)
                            except Exception:  # noqa: BLE001 - a restarted engine has no such group
                                pass
                        connect(todo.index(e))
                        report.groups_made = sender.groups_made - groups_before
                        body["group_name"] = links[e].group_name
                        call = pool.submit(xfer.admin, assigned[e], "/admin/weights/update", body)
                        sender.send(links[e], bucket, call)
                        call.result(timeout=sender.timeout_s)

                for k, _, exc in parallel(send, list(range(len(active)))):
                    if exc is not None:
                        e = active[k]
                        report.failed[e] = f"bucket {report.buckets} failed: {error_message(exc)}"
                        link = sender.drop(e)
                        if link is not None:
                            try:  # the engine may still hold its end of the group
                                _destroy_remote(xfer, link)
                            except Exception:  # noqa: BLE001
                                pass
            lap("transfer")
        finally:
            pool.shutdown(wait=False)
        report.loaded = [e for e in todo if e not in report.failed]

        # 6. every proxy learns the version and which engines have it whole
        body = {"version": version, "updated": report.loaded + report.skipped, "failed": report.failed}
        results = parallel(lambda i: client.admin(i, "/admin/weights/commit", body), every)
        fail_first("version", results)
        lap("version")
    except BaseException:
        resume_all(client, urls, every, None)  # none is left paused; the original error wins
        raise

    # 7. every proxy resumes
    resume_and_time(client, urls, every, before_resume, report, lap)
    if report.failed:
        first = next(iter(report.failed))
        detail = "; ".join(f"{e}: {why}" for e, why in report.failed.items())
        raise PublishError(
            "transfer", report.loaders.get(first, urls[0]),
            f"{len(report.failed)} engine(s) did not get the whole weights and stay out of rotation ({detail}); "
            f"{len(report.loaded) + len(report.skipped)} engine(s) serve v{version}; retry, or publish from disk",
            report, engines=list(report.failed),
        )  # fmt: skip
    report.ok = True
    return report


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
        return publish_tensors(self.client.urls, named, version, sender=self.sender, client=self.client, bucket_mb=self.bucket_mb)

    def close(self) -> None:
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
