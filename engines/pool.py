"""``EnginePool``: the one object the proxy uses to reach its engines.

It owns the policy version ``V``, routes each session to a replica (consistent hashing, or
``routing="least-loaded"``: least in-flight at first placement, then sticky; failover along the
ring either way), runs the abort-resume loop (R1, ``engines.resume``), computes
prefill-only logprobs (R2), and broadcasts pause / resume / weight updates to every replica.

Pause semantics: ``pause()`` clears the resume event *before* the engines abort their requests,
so every aborted request is held until ``resume()``; a resumed segment is sent under the version
current at that moment. Requests that arrive while paused wait too (they would block on the
engine anyway, and would be stamped with a stale version). Pausing is all or nothing: when a
reachable replica refuses to pause, the replicas that did pause are resumed, the pool is left
unpaused (held requests continue) and the failing replica's error is raised.

Engine facts: ``start()`` asks every replica what it is (``EngineInfo``: context length, model
path, served model, weight version, whether it can pause and reload) and ``pool.info`` merges
them. Context rule: a turn's output is capped so that ``prompt + output + 1 <=
context_length`` (``max_new_tokens``): the recompute prefill of the whole turn (R2; vLLM
samples one token even in a prefill, SGLang rejects an input of ``context_length`` tokens) and
the abort-resume prefill (R1) then always fit.

Versions (docs/fleet.md): a token's version is the version of the weights that sampled it, read
from the engine where it reports one (SGLang ``meta_info.weight_version`` on every reply; vLLM
``GET /weight_info`` read after each call), never from this pool's belief, which may lag when
several proxies share the engines. ``start()`` adopts the version the engines report (a proxy
that was down during an update catches up), and the health loop follows the engines forward.
``update_weights(..., engines=[...])`` loads on named replicas only (a fleet loads each engine
once, through one proxy) and skips a replica that already reports the version (idempotent).

Files, one job each (``EnginePool`` is this module's state plus one mixin per job):
``engines.replica`` (``Replica``, ``engine_id``, ``merge_info``; re-exported here),
``engines.pool_routing`` (routing, failover, health loop), ``engines.pool_generate`` (R1 and R2),
``engines.pool_weights`` (pause / resume / weight updates from disk) and
``engines.pool_transfer`` (the in-memory weight transfer's admin side).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Literal

import httpx

from engines.client import EngineClient
from engines.http_transport import EngineTransport
from engines.pool_generate import GenerationMixin
from engines.pool_routing import RoutingMixin
from engines.pool_transfer import TransferMixin
from engines.pool_weights import WeightsMixin
from engines.replica import Replica, engine_id, merge_info
from engines.routing import ROUTING_POLICIES, HashRing, StickyTable
from engines.sglang import SGLangClient
from engines.types import ContextLengthExceeded, EngineError, EngineInfo, EngineUnsupported
from engines.vllm import VLLMClient

log = logging.getLogger(__name__)

EngineKind = Literal["sglang", "vllm"]

__all__ = ["EngineKind", "EnginePool", "Replica", "engine_id", "merge_info"]


class EnginePool(RoutingMixin, GenerationMixin, WeightsMixin, TransferMixin):
    """Replicas of one engine kind behind a hash ring, with the policy version and R1/R2."""

    def __init__(
        self,
        kind: str,
        urls: list[str],
        *,
        model: str = "",
        version: int = 0,
        timeout_s: float = 600.0,
        health_interval_s: float = 5.0,
        http_client: httpx.AsyncClient | None = None,
        vnodes: int = 160,
        routing: str = "hash",
        sticky_capacity: int = 100_000,
        prefill_concurrency: int = 2,
        transfer_deadline_s: float = 600.0,
    ):
        kind = "sglang" if kind == "reference" else kind  # the reference engine speaks SGLang's API
        if kind not in ("sglang", "vllm"):
            raise ValueError(f"unknown engine kind {kind!r} (expected 'sglang' or 'vllm')")
        if not urls:
            raise ValueError("EnginePool needs at least one engine URL")
        self.kind: EngineKind = kind  # type: ignore[assignment]
        self.model = model
        self.timeout_s = timeout_s
        self.health_interval_s = health_interval_s
        self._owns_http = http_client is None
        self._http = http_client or httpx.AsyncClient(transport=EngineTransport())
        self._replicas: dict[str, Replica] = {}
        for url in urls:
            client: EngineClient
            if kind == "sglang":
                client = SGLangClient(self._http, url, timeout_s=timeout_s)
            else:
                client = VLLMClient(self._http, url, model=model, timeout_s=timeout_s)
            if client.url in self._replicas:
                raise ValueError(f"duplicate engine URL {client.url}")
            self._replicas[client.url] = Replica(client.url, client)
        self._ring = HashRing(self._replicas, vnodes=vnodes)
        if routing not in ROUTING_POLICIES:
            raise ValueError(f"unknown routing policy {routing!r} (expected one of {', '.join(ROUTING_POLICIES)})")
        self.routing = routing
        self._sticky = StickyTable(sticky_capacity) if routing == "least-loaded" else None
        self._version = int(version)
        self._paused = False
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._closed = False
        self._in_flight = 0
        self._held = 0
        self._model_path: str | None = None
        self._health_task: asyncio.Task | None = None
        self._info = EngineInfo()
        if prefill_concurrency < 1:
            raise ValueError("prefill_concurrency must be at least 1")
        self.prefill_concurrency = int(prefill_concurrency)  # R2 prefills in flight per replica
        self._prefill_slots: dict[str, asyncio.Semaphore] = {}
        self.prefill_calls = 0  # R2 prefill-only calls sent (counted for /metrics and benches)
        # A weight transfer with no news (no join, bucket or commit) for this long is abandoned:
        # see expire_transfers. ``_transfer``: the version and engine ids of the latest begin.
        self.transfer_deadline_s = float(transfer_deadline_s)
        self.expired_transfers = 0
        self._transfer: tuple[int, frozenset[str]] | None = None
        self.prefill_tokens = 0  # tokens those calls sent

    # -- state ----------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The current policy version V."""
        return self._version

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def urls(self) -> list[str]:
        return list(self._replicas)

    @property
    def info(self) -> EngineInfo:
        """The engines' own facts, merged over replicas (read by ``start()``): the smallest
        context length, the first replica's model path / served model, the weight version when
        all replicas agree, ``can_pause`` / ``can_reload`` only when every replica can."""
        return self._info

    @property
    def context_length(self) -> int | None:
        return self._info.context_length

    def max_new_tokens(self, prompt_len: int, requested: int | None = None) -> int:
        """The output budget for a prompt of ``prompt_len`` tokens: ``requested`` (None: as
        much as fits) capped at ``context_length - prompt_len - 1``, so prompt + output plus the
        one token a recompute prefill needs always fit the engine's context.

        Raises ``ContextLengthExceeded`` when not even one output token fits. With an unknown
        context length, returns ``requested`` (or raises ``ValueError`` when it is None too).
        """
        ctx = self._info.context_length
        if ctx is None:
            if requested is None:
                raise ValueError("the engine's context length is unknown: pass an explicit max_new_tokens")
            return int(requested)
        room = ctx - int(prompt_len) - 1
        if room < 1:
            raise ContextLengthExceeded(
                f"the prompt has {prompt_len} tokens; the engine's context length is {ctx} tokens, which "
                f"leaves no room for output (prompt + output + 1 must fit)"
            )
        return room if requested is None else max(0, min(int(requested), room))

    def set_version(self, v: int, *, model_path: str | None = None) -> None:
        """Set V when the weights were moved by other means: by the trainer itself, or (in a
        fleet) through another proxy that loaded them on these engines. ``model_path``, when
        given, is what a replica that comes back stale is brought up to."""
        self._version = int(v)
        if model_path:
            self._model_path = model_path

    async def announce_version(self, v: int, *, model_path: str | None = None) -> None:
        """The weights became ``v`` by other means: tell the engines that keep a version of their
        own (vLLM's ``/weight_info``, which stamps tokens), then adopt it."""
        await asyncio.gather(*(r.client.set_weight_version(v) for r in self._replicas.values() if r.healthy and r.out_of_rotation is None))
        self.set_version(v, model_path=model_path)
        await self._lift_completed(force=True)  # a disk publish may have completed an interrupted transfer

    def replica_ids(self) -> list[str]:
        return [r.id for r in self._replicas.values()]

    def status(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "version": self._version,
            "paused": self._paused,
            "in_flight": self._in_flight,
            "held": self._held,
            "context_length": self._info.context_length,
            "can_pause": self._info.can_pause,
            "can_reload": self._info.can_reload,
            "routing": self.routing,
            "replicas": [
                {"url": r.url, "healthy": r.healthy, "stale": r.stale, "in_flight": r.in_flight}
                for r in self._replicas.values()
            ],
            # replicas whose weight transfer began and did not complete: no traffic until a
            # complete publish (docs/weight_transfer.md)
            "out_of_rotation": {r.id: r.out_of_rotation for r in self._replicas.values() if r.out_of_rotation is not None},
            "expired_transfers": self.expired_transfers,
            "transfer_deadline_s": self.transfer_deadline_s,
            # per replica: the engine's stable identity (what a fleet publish deduplicates on)
            # and the weight version the engine last reported
            "engine_replicas": [
                {"id": r.id, "url": r.url, "healthy": r.healthy, "stale": r.stale, "weight_version": r.version, "out_of_rotation": r.out_of_rotation, "epoch": r.epoch}
                for r in self._replicas.values()
            ],
        }

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self, *, require_control: bool = False) -> None:
        """Probe the replicas, read their facts (``info``), start health checks.

        vLLM requests need the served model's name: when none was given it is the engine's.
        Missing pause / reload endpoints are logged as warnings (the pool still serves
        generation); ``require_control=True`` makes them an ``EngineUnsupported`` error.
        """
        await self.health()
        await self.refresh_info()
        self._follow_engines(backwards=True)
        if self.kind == "vllm" and not self.model and self._info.served_model:
            self.model = self._info.served_model
            for r in self._replicas.values():
                r.client.model = self.model  # type: ignore[attr-defined]
        for w in self._info.warnings:
            log.warning("%s", w)
        if require_control and not (self._info.can_pause and self._info.can_reload):
            raise EngineUnsupported("engines lack pause / weight-update endpoints: " + "; ".join(self._info.warnings))
        if self.health_interval_s > 0 and self._health_task is None:
            self._health_task = asyncio.create_task(self._health_loop(), name="splice-engine-health")

    async def refresh_info(self) -> EngineInfo:
        """Ask every healthy replica for its ``EngineInfo`` and merge them into ``info``."""

        async def ask(r: Replica) -> None:
            if not r.healthy:
                return
            try:
                r.info = await r.client.info()
                if r.info.weight_version is not None:
                    r.version = r.info.weight_version
            except EngineError as exc:
                self._note_error(r, exc)
                log.warning("could not read the engine facts of %s: %s", r.url, exc)
            except Exception as exc:  # noqa: BLE001 - facts are advisory; never block start-up
                log.warning("could not read the engine facts of %s: %r", r.url, exc)

        await asyncio.gather(*(ask(r) for r in self._replicas.values()))
        self._info = merge_info([r.info for r in self._replicas.values()], [r.url for r in self._replicas.values()])
        return self._info

    async def close(self) -> None:
        """Stop health checks, release held requests (they fail with EngineUnavailable)."""
        self._closed = True
        self._resumed.set()
        if self._health_task is not None:
            self._health_task.cancel()
            try:
                await self._health_task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001
                pass
            self._health_task = None
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> "EnginePool":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
