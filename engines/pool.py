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
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any, Awaitable, Callable, Literal, Sequence

import httpx

from engines.client import EngineClient, TokensCallback
from engines.resume import Stitcher, parse_version
from engines.routing import ROUTING_POLICIES, HashRing, StickyTable
from engines.sglang import SGLangClient
from engines.types import (
    EngineImage,
    ContextLengthExceeded,
    EngineError,
    EngineInfo,
    EnginePaused,
    EngineRejected,
    EngineUnavailable,
    EngineUnsupported,
    EngineVersionChanged,
    Generation,
    SamplingParams,
)
from engines.vllm import TIED_HEAD_WARNING, VLLMClient
from engines.weight_transfer import TensorBatch, WeightGroup

log = logging.getLogger(__name__)

EngineKind = Literal["sglang", "vllm"]

_MAX_IDLE_BACKOFF_S = 1.0


@dataclass
class Replica:
    """One engine replica and what the pool knows about it."""

    url: str
    client: EngineClient
    healthy: bool = True
    stale: bool = False  # missed a weight update: not routed to until it has the current weights
    in_flight: int = 0
    info: EngineInfo | None = None  # what the replica said at start(); None if it was down
    version: int | None = None  # the weight version the engine last reported (None: unknown)
    reports_version: bool = True  # False once a vLLM replica showed it has no /weight_info
    # Why the replica takes no traffic at all: a weight transfer to it began and has not
    # completed (its weights may be part old, part new). Lifted by a complete publish: the
    # engine then reports ``target_version``.
    out_of_rotation: str | None = None
    target_version: int | None = None
    # The transfer that took it out: when this proxy last heard of it (begin, join, a bucket;
    # time.monotonic()), and whether its weights may have started changing (a join or a bucket
    # was issued, or a commit listed it as failed). None: no transfer pending.
    transfer_seen: float | None = None
    transfer_touched: bool = False
    epoch: int = 0  # bumped each time the replica comes back after being down (it may have restarted)

    @property
    def usable(self) -> bool:
        return self.healthy and not self.stale and self.out_of_rotation is None

    @property
    def id(self) -> str:
        """A stable identity for the engine behind this replica: its URL (credentials redacted),
        scheme and host lower-cased, no trailing slash. Proxies that name an engine the same way
        report the same id, which is how a fleet publish loads each engine once."""
        return engine_id(self.url)


def engine_id(url: str) -> str:
    """``Replica.id`` for a URL (see there)."""
    import urllib.parse

    url = url.strip().rstrip("/")
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return url
    netloc = parts.netloc
    userinfo, at, hostport = netloc.rpartition("@")
    netloc = f"{userinfo}{at}{hostport.lower()}"
    return urllib.parse.urlunsplit((parts.scheme.lower(), netloc, parts.path.rstrip("/"), parts.query, ""))


class EnginePool:
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
        self._http = http_client or httpx.AsyncClient(
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None)
        )
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

    # -- routing --------------------------------------------------------------------------------

    def replica_for(self, session_id: str) -> str:
        """The replica a new request of ``session_id`` goes to now (sticky unless it is down)."""
        return self._candidates(session_id)[0].url

    def _candidates(self, session_id: str) -> list[Replica]:
        """Ring order for the session: usable replicas first (the owner unless it is down), then
        those believed down (health may be out of date), stale ones last."""
        ring = self._ring.preference(session_id)
        if self._sticky is not None:
            load = {u: r.in_flight for u, r in self._replicas.items()}
            ring = self._sticky.place(session_id, ring, load, lambda u: self._replicas[u].usable)
        order = [self._replicas[u] for u in ring if self._replicas[u].out_of_rotation is None]
        if not order:
            reasons = "; ".join(f"{r.url}: {r.out_of_rotation}" for r in self._replicas.values())
            raise EngineUnavailable(f"every engine replica is out of rotation ({reasons}); publish the weights again", retryable=False)
        return sorted(order, key=lambda r: (r.stale, not r.healthy))  # stable: keeps ring order

    def _note_error(self, replica: Replica, exc: EngineError) -> None:
        if isinstance(exc, EngineUnavailable):
            if replica.healthy:
                log.warning("engine replica %s is unavailable: %s", replica.url, exc)
            replica.healthy = False
        if not exc.replica:
            exc.replica = replica.url

    async def _call_with_failover(
        self, session_id: str, call: Callable[[Replica], Awaitable[Any]], *, may_retry: Callable[[], bool]
    ) -> tuple[Replica, Any]:
        """Run ``call`` on the session's replica; on a retryable failure, once on the next one
        (or, with a single replica, once more on the same one: a kept-alive connection the engine
        closed under load fails before anything was sent back)."""
        candidates = self._candidates(session_id)
        tries = candidates[:2] if len(candidates) > 1 else candidates * 2
        last: EngineError | None = None
        for attempt, replica in enumerate(tries):
            if attempt == 1 and not (last is not None and last.retryable and may_retry() and not replica.stale):
                break
            if attempt == 1 and replica is tries[0]:
                await asyncio.sleep(0.05)
            replica.in_flight += 1
            try:
                return replica, await call(replica)
            except EngineError as exc:
                self._note_error(replica, exc)
                last = exc
            finally:
                replica.in_flight -= 1
            if isinstance(last, EngineRejected):
                break
        assert last is not None
        raise last

    # -- generation (R1) ------------------------------------------------------------------------

    async def _wait_resumed(self) -> None:
        if not self._resumed.is_set():
            self._held += 1
            try:
                await self._resumed.wait()
            finally:
                self._held -= 1
        if self._closed:
            raise EngineUnavailable("the engine pool is closed")

    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        *,
        session_id: str,
        on_tokens: TokensCallback | None = None,
        prompt_logprobs_from: int | None = None,
        images: Sequence[EngineImage] = (),
    ) -> Generation:
        """Generate until stop / length, riding through any number of pause-abort-resume cycles.

        ``on_tokens(ids, logprobs)`` receives output tokens as they are
        sampled (the call streams from the engine then). Raises ``EngineError``; its
        ``retryable`` is False once any token was produced.

        ``prompt_logprobs_from=k`` (1 <= k < len(input_ids)) also asks the first engine call for
        the input logprobs of prompt positions k.. (R2 on a session's next turn), returned in
        ``Generation.prompt_logprobs`` with the version that computed them. Only ask when a
        token there is owed a value: input logprobs cap the engine's prefix cache.

        ``images``: every image of ``input_ids`` (``EngineImage`` spans over the expanded ids,
        prompt order). Every engine call of the generation carries them, resumes included.
        """
        if prompt_logprobs_from is not None and not 1 <= prompt_logprobs_from < len(input_ids):
            prompt_logprobs_from = None  # nothing placeable: a plain call
        if self._closed:
            raise EngineUnavailable("the engine pool is closed")
        if self._info.context_length is not None:
            params = replace(params, max_new_tokens=self.max_new_tokens(len(input_ids), params.max_new_tokens))
        stitch = Stitcher(list(input_ids), params, prompt_logprobs_from=prompt_logprobs_from, images=tuple(images))
        delivered = 0

        async def counting(ids: list[int], logprobs: list[float]) -> None:
            nonlocal delivered
            delivered += len(ids)
            await on_tokens(ids, logprobs)

        cb: TokensCallback | None = counting if on_tokens is not None else None

        replica: Replica | None = None
        backoff = 0.0
        self._in_flight += 1
        try:
            while True:
                await self._wait_resumed()
                sent_version = self._version
                frm = stitch.logprobs_from(sent_version)
                body_ids = stitch.next_input_ids()
                body_params = stitch.next_params()
                body_images = stitch.next_images()
                rid = f"splice-{session_id[:64]}-{uuid.uuid4().hex[:12]}"
                t0 = time.perf_counter()

                async def call(r: Replica) -> Any:
                    if body_images:
                        return await r.client.generate(
                            body_ids, body_params, rid=rid, input_logprobs_from=frm, on_tokens=cb, routing_key=session_id,
                            images=body_images,
                        )
                    return await r.client.generate(
                        body_ids, body_params, rid=rid, input_logprobs_from=frm, on_tokens=cb, routing_key=session_id
                    )

                try:
                    if replica is None or replica.out_of_rotation is not None:
                        # first segment, or its replica's weights are being replaced: pick by
                        # session, fail over once
                        replica, seg = await self._call_with_failover(
                            session_id, call, may_retry=lambda: delivered == 0
                        )
                    else:  # a resume stays where its tokens were produced
                        replica.in_flight += 1
                        try:
                            seg = await call(replica)
                        except EngineError as exc:
                            self._note_error(replica, exc)
                            raise
                        finally:
                            replica.in_flight -= 1
                except EngineError as exc:
                    if stitch.generated or delivered:
                        exc.retryable = False
                    raise
                finally:
                    stitch.gen.engine_time_s += time.perf_counter() - t0
                replica.healthy = True
                seg = await self._engine_version(replica, seg)
                stitch.add(seg, sent_version)
                if stitch.settle():
                    break
                if self._resumed.is_set():
                    # Aborted although Splice did not pause (someone paused the engine directly):
                    # re-send; the engine holds it until it continues. Back off if it keeps aborting.
                    await asyncio.sleep(backoff)
                    backoff = min(_MAX_IDLE_BACKOFF_S, backoff * 2 or 0.05)
                else:
                    backoff = 0.0
        finally:
            self._in_flight -= 1
        gen = stitch.gen
        gen.replica = replica.url
        gen.check()
        return gen

    async def _read_version(self, replica: Replica) -> str | None:
        """The replica's weight version read from the engine now (vLLM ``/weight_info``), for a
        reply that did not carry one; None when the engine cannot say."""
        if not replica.reports_version:
            return None
        try:
            reported = await replica.client.weight_version()
        except Exception as exc:  # noqa: BLE001 - a fact we cannot read falls back to V
            log.debug("could not read the weight version of %s: %r", replica.url, exc)
            return None
        if reported is None:
            replica.reports_version = False  # no /weight_info (vLLM without dev mode): stop asking
            return None
        v = parse_version(reported)
        if v is not None:
            replica.version = v
        return reported

    async def _engine_version(self, replica: Replica, seg: Any) -> Any:
        """``seg`` with the engine's weight version filled in where the reply had none.

        vLLM completions carry no version, so it is read from ``/weight_info`` right after the
        call: weights only change while the engine is paused and a pause aborts running calls,
        so a call that completed ran under the version the engine reports next (an update that
        slipped in between would need a whole pause and load, which is far slower than this
        read). An aborted call's tokens are stamped the same way: the abort came from the pause
        that precedes any load. Falls back to the pool's V when the engine does not say.
        """
        if seg.weight_version is not None:
            v = parse_version(seg.weight_version)
            if v is not None:
                replica.version = v
            return seg
        if not seg.output_ids and not seg.input_logprobs:
            return seg
        reported = await self._read_version(replica)
        return seg if reported is None else replace(seg, weight_version=reported)

    # -- prefill (R2) ---------------------------------------------------------------------------

    async def prefill_logprobs(
        self, input_ids: list[int], start: int, *, session_id: str, images: Sequence[EngineImage] = ()
    ) -> list[float]:
        """log pi_V(x_k | x_<k) for every k in [start, len(input_ids)), V = ``self.version``.
        ``images``: every image of ``input_ids`` (as for ``generate``); values at image pad
        positions are the engine's, never owed.

        Raises ``EnginePaused`` while paused (the engines would hold the call until resume) and
        ``EngineVersionChanged`` if the weights changed while it ran, so a value is never
        credited to the wrong version.
        """
        if not 1 <= start <= len(input_ids):
            raise ValueError(f"start must be in [1, {len(input_ids)}], got {start}")
        if start == len(input_ids):
            return []
        if self._paused:
            raise EnginePaused("engines are paused; prefill after resume")
        version = self._version
        ids = list(input_ids)
        imgs = tuple(images)

        async def call(r: Replica):
            async with self._prefill_slot(r):  # bounded per replica: turns keep their share
                self.prefill_calls += 1
                self.prefill_tokens += len(ids)
                if imgs:
                    return await r.client.prefill(ids, start, routing_key=session_id, images=imgs)
                return await r.client.prefill(ids, start, routing_key=session_id)

        replica, (values, reported) = await self._call_with_failover(session_id, call, may_retry=lambda: True)
        if reported is None:
            reported = await self._read_version(replica)
        engine_version = parse_version(reported)
        if self._version != version or (engine_version is not None and engine_version != version):
            raise EngineVersionChanged(
                f"weights changed during the prefill (pool v{self._version}, engine {reported}, sent at v{version})"
            )
        return values

    def _prefill_slot(self, r: Replica) -> asyncio.Semaphore:
        slot = self._prefill_slots.get(r.url)
        if slot is None:
            slot = self._prefill_slots[r.url] = asyncio.Semaphore(self.prefill_concurrency)
        return slot

    # -- admin ----------------------------------------------------------------------------------

    async def _broadcast(
        self, what: str, op: Callable[[Replica], Awaitable[None]], replicas: list[Replica] | None = None
    ) -> list[Replica]:
        """Run ``op`` on every replica (or those given) concurrently. Returns the replicas that were
        unreachable; raises when a reachable replica failed or none succeeded."""
        replicas = list(self._replicas.values()) if replicas is None else replicas
        results = await asyncio.gather(*(op(r) for r in replicas), return_exceptions=True)
        down: list[Replica] = []
        errors: list[str] = []
        for r, res in zip(replicas, results):
            if isinstance(res, EngineUnavailable):
                self._note_error(r, res)
                down.append(r)
            elif isinstance(res, BaseException):
                errors.append(f"{r.url}: {res}")
        if errors or len(down) == len(replicas):
            detail = "; ".join(errors or [f"{r.url} unavailable" for r in down])
            err_types = {type(res) for res in results if isinstance(res, EngineError)}
            cls = err_types.pop() if len(err_types) == 1 else EngineError
            raise cls(f"{what} failed: {detail}", retryable=False)
        return down

    async def pause(self) -> None:
        """Pause every replica (mode abort). In-flight requests come back partial and are held.

        All or nothing: if a reachable replica fails to pause, the replicas that paused are
        resumed, the pool is left unpaused (held requests go on) and the failing replica's error
        is raised, naming it. An unreachable replica is skipped as in every broadcast (it serves
        nothing; a weight update then marks it stale); all of them unreachable is an error.
        """
        self._paused = True
        self._resumed.clear()
        replicas = list(self._replicas.values())
        results = await asyncio.gather(*(r.client.pause() for r in replicas), return_exceptions=True)
        paused = [r for r, res in zip(replicas, results) if not isinstance(res, BaseException)]
        failed: list[tuple[Replica, BaseException]] = []
        for r, res in zip(replicas, results):
            if isinstance(res, EngineUnavailable):
                self._note_error(r, res)
            elif isinstance(res, BaseException):
                failed.append((r, res))
        if not failed and paused:
            return
        if not failed:  # every replica unreachable
            failed = [(r, res) for r, res in zip(replicas, results) if isinstance(res, BaseException)]
        undo = await asyncio.gather(*(r.client.resume() for r in paused), return_exceptions=True)
        not_resumed = [r.url for r, res in zip(paused, undo) if isinstance(res, BaseException)]
        self._paused = False
        self._resumed.set()
        first_r, first_exc = failed[0]
        detail = "; ".join(f"{r.url}: {exc}" for r, exc in failed)
        msg = f"pause failed on {', '.join(r.url for r, _ in failed)} ({detail}); resumed {len(paused) - len(not_resumed)} replica(s) that had paused; the pool is not paused"
        if not_resumed:
            msg += f"; could not resume {', '.join(not_resumed)}"
        cls = type(first_exc) if isinstance(first_exc, EngineError) else EngineError
        try:
            err = cls(msg, replica=first_r.url, retryable=False)
        except TypeError:
            err = EngineError(msg, replica=first_r.url, retryable=False)
        raise err from first_exc

    async def resume(self) -> None:
        """Resume every replica; held requests re-send (and pick up their proximal values)."""
        await self._lift_completed(force=True)  # a publish through other proxies may have completed them
        try:
            await self._broadcast("resume", lambda r: r.client.resume())
        finally:
            self._paused = False
            self._resumed.set()

    async def update_weights(self, model_path: str, version: int, *, engines: list[str] | None = None) -> dict[str, list[str]]:
        """Load ``model_path`` on every replica (or only those whose ``id`` is in ``engines``) as
        ``version``, then make it V. A replica whose engine already reports ``version`` is not
        loaded again (a re-run publish is idempotent). Returns ``{"loaded": [...], "skipped":
        [...], "stale": [...]}`` (replica ids).

        A replica that is down is marked stale (no traffic) and brought up to date by the health
        loop when it returns; V is set as long as one replica has the new weights. When a
        reachable replica fails to load them this raises ``EngineError`` and V is unchanged
        (retry the update). ``model_path`` is a path on the engines' filesystem, passed untouched
        (SGLang ``/update_weights_from_disk``; vLLM dev mode ``/collective_rpc`` reload_weights,
        then ``/update_weight_version``, read back from ``/weight_info``); a vLLM without dev mode
        raises ``EngineUnsupported`` (use ``set_version``).
        """

        selected: list[Replica] | None = None
        if engines is not None:
            by_id = {r.id: r for r in self._replicas.values()}
            unknown = [e for e in engines if engine_id(e) not in by_id]
            if unknown:
                raise ValueError(f"unknown engine(s) {unknown}; this proxy's engines are {sorted(by_id)}")
            selected = [by_id[engine_id(e)] for e in dict.fromkeys(engines)]
        loaded: list[str] = []
        skipped: list[str] = []

        async def load(r: Replica) -> None:
            try:
                now = parse_version(await r.client.weight_version())
            except EngineUnavailable:
                raise
            except Exception:  # noqa: BLE001 - cannot tell: load (loading twice is only slower)
                now = None
            if now == int(version):
                skipped.append(r.id)  # already serving this version: do not load it twice
            else:
                await r.client.update_weights(model_path, version)
                loaded.append(r.id)
            r.version = int(version)
            r.stale = False
            _back_in_rotation(r)  # whole weights again

        if self.kind == "vllm" and self._info.tied_lm_head and not self._info.worker_extension:
            log.warning("vLLM update_weights(%r): %s", model_path, TIED_HEAD_WARNING)
        if selected == []:
            down: list[Replica] = []
        else:
            down = await self._broadcast(f"update_weights({model_path!r}, v{version})", load, selected)
        for r in down:
            r.stale = True
        self._model_path = model_path
        self._version = int(version)
        await self._lift_completed(force=True)  # replicas whose interrupted transfer this load completed (via another proxy)
        return {"loaded": loaded, "skipped": skipped, "stale": [r.id for r in down]}

    # -- weights over torch.distributed (docs/weight_transfer.md) ------------------------------

    def _by_id(self, engine: str) -> Replica:
        by_id = {r.id: r for r in self._replicas.values()}
        r = by_id.get(engine_id(engine))
        if r is None:
            raise ValueError(f"unknown engine {engine!r}; this proxy's engines are {sorted(by_id)}")
        return r

    async def weight_ranks(self, engine: str) -> int:
        """How many ranks ``engine`` joins a weight-update group with (its GPUs)."""
        return await self._by_id(engine).client.weight_ranks()

    async def init_weights_group(self, engine: str, group: WeightGroup) -> None:
        """Make the engine join ``group`` (the trainer joins as rank 0 meanwhile)."""
        r = self._by_id(engine)
        if r.transfer_seen is not None:  # joining is part of the pending transfer: news of it
            r.transfer_seen = time.monotonic()
            r.transfer_touched = True
        try:
            await r.client.init_weights_group(group)
        except EngineError as exc:
            self._note_error(r, exc)
            raise
        r.healthy = True

    async def destroy_weights_group(self, engine: str, group_name: str) -> None:
        r = self._by_id(engine)
        await r.client.destroy_weights_group(group_name)

    def begin_transfer(self, engines: list[str], version: int) -> list[str]:
        """Take the replicas of ``engines`` (those this proxy has) out of rotation before their
        weights start changing; returns their ids. A complete transfer puts them back."""
        wanted = {engine_id(e) for e in engines}
        self._transfer = (int(version), frozenset(wanted))
        marked = []
        now = time.monotonic()
        for r in self._replicas.values():
            if r.id in wanted:
                r.out_of_rotation = f"receiving weights v{int(version)}"
                r.target_version = int(version)
                if r.transfer_seen is None:
                    r.transfer_touched = False
                r.transfer_seen = now
                marked.append(r.id)
        return marked

    async def update_weights_from_distributed(self, engine: str, batch: TensorBatch) -> None:
        """One bucket to one engine; the final bucket stamps ``batch.version`` and puts the
        replica back in rotation. A failed bucket leaves it out, with the reason."""
        r = self._by_id(engine)
        r.out_of_rotation = r.out_of_rotation or f"receiving weights v{batch.version}"
        r.target_version = batch.version
        r.transfer_seen = time.monotonic()
        r.transfer_touched = True  # whatever the engine answers, its weights may have begun to change
        try:
            await r.client.update_weights_from_distributed(batch)
        except EngineError as exc:
            self._note_error(r, exc)
            r.out_of_rotation = f"the transfer of v{batch.version} stopped half way: {exc}"
            raise
        r.healthy = True
        if batch.final:
            r.version = batch.version
            r.stale = False
            _back_in_rotation(r)

    def commit_transfer(self, version: int, updated: list[str], failed: dict[str, str]) -> dict[str, list[str]]:
        """After a fleet transfer: engines in ``updated`` serve ``version`` (back in rotation),
        those in ``failed`` stay out with the reason. V becomes ``version`` when an engine of
        this transfer has it; the weights of V live on no filesystem, so a stale replica is no
        longer reloaded from an older path.

        An engine counts only if it is one of this proxy's or was named by the ``begin`` of this
        version (a fleet's commit names every engine of the fleet); others are returned as
        ``ignored``, and a commit naming none at all is a ``ValueError``: a stray or mistaken
        commit never moves the version."""
        known = {r.id for r in self._replicas.values()}
        if self._transfer is not None and self._transfer[0] == int(version):
            known |= self._transfer[1]
        ok = {engine_id(e) for e in updated} & known
        bad = {engine_id(e): why for e, why in failed.items() if engine_id(e) in known}
        ignored = sorted({engine_id(e) for e in [*updated, *failed]} - known)
        if not ok and not bad:
            raise ValueError(
                f"the commit of v{int(version)} names no engine of this proxy or of a transfer of v{int(version)} begun here "
                f"(it names {ignored or 'none'}; this proxy's engines are {sorted(r.id for r in self._replicas.values())})"
            )
        now = time.monotonic()
        for r in self._replicas.values():
            if r.id in ok:
                r.version = int(version)
                r.stale = False
                _back_in_rotation(r)
            elif r.id in bad:
                r.out_of_rotation = f"the transfer of v{int(version)} did not complete: {bad[r.id]}"
                r.target_version = int(version)
                r.transfer_seen = now
                r.transfer_touched = True
        if ok:
            self._version = int(version)
            self._model_path = None
        return {"ignored": ignored}

    def expire_transfers(self, now: float | None = None) -> list[str]:
        """Replicas out of rotation for a transfer with no news for ``transfer_deadline_s``.

        Their weights may be mixed (a fleet's other proxies may have sent buckets this one never
        saw), so none goes back as it is. When V's weights are on disk (the last publish was a
        load from a path), the replica is marked stale and reloaded from that path by the health
        check, then serves again; otherwise it stays out, its status saying the transfer was
        abandoned and that a publish brings it back. Logged once (WARNING) and counted."""
        now = time.monotonic() if now is None else now
        expired = []
        for r in self._replicas.values():
            if r.out_of_rotation is None or r.transfer_seen is None or now - r.transfer_seen < self.transfer_deadline_s:
                continue
            target = r.target_version
            r.transfer_seen = None  # expired once
            self.expired_transfers += 1
            expired.append(r.id)
            if self._model_path is not None:
                log.warning("the weight transfer of v%s to %s was abandoned (no news for %g s): reloading v%d from %s",
                            target, r.url, self.transfer_deadline_s, self._version, self._model_path)  # fmt: skip
                _back_in_rotation(r)
                r.stale = True  # not routed to until the health check reloads the path
                continue
            touched = "its weights may be mixed" if r.transfer_touched else "its weights may be mixed (another proxy may have sent buckets)"
            r.out_of_rotation = (
                f"the transfer of v{target} was abandoned: no join, bucket or commit for {self.transfer_deadline_s:g} s; "
                f"{touched}; a publish (a disk load or a new transfer) brings it back"
            )
            log.warning("engine replica %s stays out of rotation: %s", r.url, r.out_of_rotation)
        return expired

    async def _lift_completed(self, *, force: bool = False) -> None:
        """Put back in rotation a replica whose engine now reports the version its interrupted
        transfer was for (a later publish completed it, through this proxy or another)."""
        out = [r for r in self._replicas.values() if r.out_of_rotation is not None and r.target_version is not None and r.healthy]
        for r in out:
            try:
                now = parse_version(await r.client.weight_version())
            except Exception:  # noqa: BLE001 - cannot tell: stays out
                continue
            if now == r.target_version and (force or not self._paused):
                log.info("engine replica %s completed v%d: back in rotation", r.url, now)
                r.version = now
                _back_in_rotation(r)

    async def health(self) -> dict[str, bool]:
        """Probe every replica now; returns and records ``{url: healthy}``."""
        replicas = list(self._replicas.values())
        oks = await asyncio.gather(*(r.client.health() for r in replicas))
        for r, ok in zip(replicas, oks):
            if ok and not r.healthy:
                r.epoch += 1  # it may be a new process: groups it had joined are gone
            if ok != r.healthy:
                log.info("engine replica %s is %s", r.url, "healthy" if ok else "unhealthy")
            r.healthy = ok
        return {r.url: r.healthy for r in replicas}

    async def _resync(self, r: Replica) -> None:
        """Give a replica that missed a weight update the current weights."""
        if self._model_path is None:
            return
        try:
            await r.client.update_weights(self._model_path, self._version)
        except EngineError as exc:
            log.warning("could not bring %s to v%d: %s", r.url, self._version, exc)
            return
        r.stale = False
        log.info("engine replica %s caught up to v%d", r.url, self._version)

    def _follow_engines(self, *, backwards: bool) -> bool:
        """Adopt the weight version the usable replicas agree on (``backwards``: also when it is
        lower than V, as at start-up, where the engines are the only truth). True if V changed."""
        v = _agreed([r.version for r in self._replicas.values() if r.usable])
        if v is None or v == self._version or (v < self._version and not backwards):
            return False
        log.info("the engines serve weight version %d: the pool's version follows (was %d)", v, self._version)
        self._version = v
        return True

    async def _poll_versions(self) -> bool:
        """Read every usable replica's weight version; follow the engines forward when they all
        moved (weights published through another proxy without this one being told)."""
        replicas = [r for r in self._replicas.values() if r.usable and r.reports_version]
        if not replicas:
            return False
        await asyncio.gather(*(self._read_version(r) for r in replicas))
        if self._paused:
            return False
        return self._follow_engines(backwards=False)

    async def _health_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.health_interval_s)
            try:
                await self.health()
                for r in self._replicas.values():
                    if r.stale and r.healthy and not self._paused and r.out_of_rotation is None:
                        await self._resync(r)
                await self._lift_completed()
                self.expire_transfers()
                if not self._paused:
                    await self._poll_versions()
            except Exception:  # noqa: BLE001 - the loop must survive anything
                log.exception("engine health check failed")


def _back_in_rotation(r: Replica) -> None:
    r.out_of_rotation = r.target_version = r.transfer_seen = None
    r.transfer_touched = False


def _agreed(versions: list[int | None]) -> int | None:
    known = {v for v in versions if v is not None}
    return known.pop() if len(known) == 1 else None


def merge_info(infos: list[EngineInfo | None], urls: list[str]) -> EngineInfo:
    """One ``EngineInfo`` for the pool from each replica's (None: the replica did not answer)."""
    known = [(u, i) for u, i in zip(urls, infos) if i is not None]
    if not known:
        return EngineInfo(warnings=("no engine replica answered at start-up: engine facts unknown",))
    warnings: list[str] = [w for _, i in known for w in i.warnings]
    contexts = [i.context_length for _, i in known if i.context_length is not None]
    if len(set(contexts)) > 1:
        warnings.append(f"replicas report different context lengths {sorted(set(contexts))}: using the smallest")
    served = [i.served_model for _, i in known if i.served_model]
    if len(set(served)) > 1:
        warnings.append(f"replicas serve different models {sorted(set(served))}")
    versions = [i.weight_version for _, i in known]
    version = versions[0] if len(set(versions)) == 1 else None
    if len(set(versions)) > 1:
        warnings.append(f"replicas report different weight versions {versions}")
    ties = [i.tied_lm_head for _, i in known if i.tied_lm_head is not None]
    return EngineInfo(
        context_length=min(contexts) if contexts else None,
        model_path=next((i.model_path for _, i in known if i.model_path), None),
        served_model=served[0] if served else None,
        weight_version=version,
        can_pause=all(i.can_pause for _, i in known),
        can_reload=all(i.can_reload for _, i in known),
        tied_lm_head=(True in ties) if ties else None,
        worker_extension=all(i.worker_extension for _, i in known),
        warnings=tuple(warnings),
    )
