"""Admin routes: the weight-update protocol (pause, update weights or version, resume) and status."""

from __future__ import annotations

import asyncio
import logging
from typing import Literal

from fastapi import APIRouter, Request
from pydantic import Field

from engines.types import EngineError
from engines.weight_transfer import TensorBatch, WeightGroup

from ..errors import APIError, bad_request, from_engine_error
from ..metrics import Metrics
from ..session import RecomputeScheduler
from ..store import Store
from .jsonio import JSONResponse, body_schema, read_model
from .streaming import disconnected, watch_client
from .models import MAX_INT32, UpdateWeightsBody, VersionBody, _Body

log = logging.getLogger("splice.admin")


class FleetUpdateWeightsBody(UpdateWeightsBody):
    # Fleet publish (docs/fleet.md): load only on these engines (ids from /admin/status
    # ``engines.engine_replicas``); the other proxies sharing them only learn the version.
    engines: list[str] | None = Field(default=None, max_length=4096)


class FleetVersionBody(VersionBody):
    # where the weights of ``version`` live on the engines: what a replica that comes back
    # stale is brought up to
    model_path: str | None = Field(default=None, max_length=4096)


_NAME = Field(min_length=1, max_length=512)
_MAX_TENSORS = 1_000_000


class WeightGroupBody(_Body):
    # Weights over torch.distributed (docs/weight_transfer.md): make ``engine`` join the
    # trainer's process group (the trainer is rank 0 and listens on master_address:master_port).
    engine: str = Field(min_length=1, max_length=4096)
    master_address: str = Field(min_length=1, max_length=255)
    master_port: int = Field(ge=1, le=65535, strict=True)
    group_name: str = _NAME
    backend: Literal["gloo", "nccl"] = "nccl"
    rank_offset: int = Field(default=1, ge=1, le=MAX_INT32, strict=True)
    world_size: int = Field(default=2, ge=2, le=MAX_INT32, strict=True)


class EngineBody(_Body):
    engine: str = Field(min_length=1, max_length=4096)


class WeightGroupNameBody(_Body):
    engine: str = Field(min_length=1, max_length=4096)
    group_name: str = _NAME


class TransferBeginBody(VersionBody):
    engines: list[str] = Field(max_length=4096)


class TensorBucketBody(VersionBody):
    engine: str = Field(min_length=1, max_length=4096)
    group_name: str = _NAME
    names: list[str] = Field(max_length=_MAX_TENSORS)
    dtypes: list[str] = Field(max_length=_MAX_TENSORS)
    shapes: list[list[int]] = Field(max_length=_MAX_TENSORS)
    first: bool = True
    final: bool = True


class TransferCommitBody(VersionBody):
    updated: list[str] = Field(default_factory=list, max_length=4096)
    failed: dict[str, str] = Field(default_factory=dict, max_length=4096)


async def _engine(coro):
    try:
        return await coro
    except EngineError as exc:
        raise from_engine_error(exc) from exc


class _ClientGone(Exception):
    """The caller of a pause disconnected (gave up) before it took effect."""


async def _unless_gone(task: asyncio.Future, gone: asyncio.Task):
    """``task``'s result, or ``_ClientGone`` if the client leaves first (``task`` keeps running)."""
    done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        return task.result()
    raise _ClientGone()


def _consume(task: asyncio.Future) -> None:
    """A background task nobody awaits any more: retrieve its outcome so it is not logged as lost."""
    task.add_done_callback(lambda t: t.cancelled() or t.exception())


class PauseGuard:
    """Keeps a pause from outliving the trainer that asked for it.

    - A pause whose caller disconnected before it took effect (it waited for owed recomputes,
      the trainer timed out) does not pause; if the caller left while the engines were being
      paused, they are resumed (nobody is left to do it).
    - A pause that started before the latest resume does not take effect (the trainer gave up
      on it and resumed: pausing now would hold every agent turn with nobody to resume them).
    - A pause not followed by a resume within ``max_pause_s`` is lifted, with a warning and a
      count in ``/admin/status``: held agent turns never wait longer than that.
    """

    def __init__(self, pool, recompute: RecomputeScheduler, max_pause_s: float):
        self.pool = pool
        self.recompute = recompute
        self.max_pause_s = max_pause_s
        self.resumes = 0  # bumped by every resume: the epoch a pause must still be in
        self.expired = 0
        self.busy = 0  # weight updates in flight: a pause is not lifted under one
        self._watchdog: asyncio.Task | None = None

    def arm(self) -> None:
        self.disarm()
        self._watchdog = asyncio.create_task(self._expire(self.resumes))

    def disarm(self) -> None:
        if self._watchdog is not None and not self._watchdog.done() and self._watchdog is not asyncio.current_task():
            self._watchdog.cancel()
        self._watchdog = None

    def resumed(self) -> None:
        self.resumes += 1
        self.disarm()

    async def _expire(self, epoch: int) -> None:
        await asyncio.sleep(self.max_pause_s)
        while self.busy:  # never resume under a weight load; it is bounded by the engine timeout
            await asyncio.sleep(0.5)
        if self.resumes != epoch or not self.pool.paused:
            return
        self.expired += 1
        log.warning(
            "the engines were paused %.0f s ago and nobody resumed them (--max-pause-s): resuming, so held agent turns go on",
            self.max_pause_s,
        )
        self.resumes += 1
        try:
            await self.pool.resume()
        except EngineError as exc:
            log.warning("resuming an expired pause failed: %s", exc)
        self.recompute.soon()


def admin_router(store: Store, pool, recompute: RecomputeScheduler, metrics: Metrics, *, max_pause_s: float = 600.0) -> APIRouter:
    r = APIRouter()
    guard = PauseGuard(pool, recompute, max_pause_s)

    @r.post("/admin/recompute")
    async def recompute_owed():
        # A fleet publish runs this on every proxy before any proxy pauses: once one proxy has
        # paused the shared engines, another proxy's recompute would wait for them to continue.
        report = await _engine(recompute.settle())
        return JSONResponse({"recomputed_tokens": report.tokens, "version": pool.version, "recompute": report.to_dict()})

    @r.post("/admin/pause")
    async def pause(request: Request):
        epoch = guard.resumes
        gone = asyncio.create_task(disconnected(request))
        try:
            # R2's deadline: owed values are settled first, waiting at most --recompute-deadline-s;
            # what is not done then is counted missing and the pause goes ahead (never blocked).
            run = request.query_params.get("recompute", "true").lower() not in ("false", "0", "no")
            report = None
            work = asyncio.ensure_future(recompute.before_pause(recompute=run))  # owed anyway: it finishes if the caller leaves
            _consume(work)
            try:
                report = await _unless_gone(work, gone)
            except EngineError as exc:
                log.warning("recompute before pause failed: %s", exc)
            if guard.resumes != epoch:
                raise APIError(409, "a resume arrived while this pause was waiting; the engines were not paused", code="pause_superseded")
            pausing = asyncio.ensure_future(pool.pause())
            try:
                await _engine(_unless_gone(pausing, gone))
            except _ClientGone:
                await _engine(pausing)
                await _engine(pool.resume())  # its caller is gone: nobody would resume
                guard.resumed()
                raise
            guard.arm()
            body = {"paused": True, "version": pool.version, "recomputed_tokens": report.tokens if report else 0}
            if report is not None:
                body["recompute"] = report.to_dict()
            return JSONResponse(body)
        except _ClientGone:
            log.warning("a pause whose caller disconnected was dropped (the engines are not paused)")
            return JSONResponse({"paused": False}, status_code=499)
        finally:
            gone.cancel()

    @r.post("/admin/update_weights", openapi_extra=body_schema(FleetUpdateWeightsBody))
    async def update_weights(request: Request):
        body = await read_model(request, FleetUpdateWeightsBody)
        # model_path is a path on the engine's filesystem: passed through, the engine decides.
        kw = {} if body.engines is None else {"engines": body.engines}
        guard.busy += 1
        try:
            report = await _engine(pool.update_weights(body.model_path, body.version, **kw))
        except ValueError as exc:  # an engine id this proxy does not have
            raise bad_request(str(exc), param="engines") from exc
        finally:
            guard.busy -= 1
        metrics.version.set(pool.version)
        await recompute.refresh()  # which sessions owe values now: their next turns compute them
        if not pool.paused:
            recompute.soon()  # closed sessions now; open ones at their next turn or the next pause
        return JSONResponse({"success": True, "version": pool.version, **(report or {})})

    @r.post("/admin/version", openapi_extra=body_schema(FleetVersionBody))
    async def set_version(request: Request):
        body = await read_model(request, FleetVersionBody)
        await _engine(pool.announce_version(body.version, model_path=body.model_path or None))
        metrics.version.set(body.version)
        await recompute.refresh()
        if not pool.paused:
            recompute.soon()
        return JSONResponse({"version": pool.version})

    @r.post("/admin/resume")
    async def resume():
        guard.resumed()
        await _engine(pool.resume())
        recompute.soon()
        return JSONResponse({"paused": False, "version": pool.version})

    # -- weights over torch.distributed: the trainer broadcasts, the proxy makes the engine take
    #    it (docs/weight_transfer.md). The engine is never told a path.

    async def _on_engine(coro):
        try:
            return await _engine(coro)
        except ValueError as exc:  # an engine id this proxy does not have
            raise bad_request(str(exc), param="engine") from exc

    @r.post("/admin/weights/ranks", openapi_extra=body_schema(EngineBody))
    async def weights_ranks(request: Request):
        b = await read_model(request, EngineBody)
        return JSONResponse({"engine": b.engine, "ranks": await _on_engine(pool.weight_ranks(b.engine))})

    @r.post("/admin/weights/init_group", openapi_extra=body_schema(WeightGroupBody))
    async def weights_init_group(request: Request):
        b = await read_model(request, WeightGroupBody)
        group = WeightGroup(b.master_address, b.master_port, b.group_name, b.backend, b.rank_offset, b.world_size)
        # a trainer that gave up takes the engine's join with it: cancelling the engine call
        # closes its connection, and an engine that watches for that stops reaching for the trainer
        await watch_client(request, asyncio.ensure_future(_on_engine(pool.init_weights_group(b.engine, group))))
        return JSONResponse({"success": True, "engine": b.engine, "group_name": b.group_name})

    @r.post("/admin/weights/destroy_group", openapi_extra=body_schema(WeightGroupNameBody))
    async def weights_destroy_group(request: Request):
        b = await read_model(request, WeightGroupNameBody)
        await _on_engine(pool.destroy_weights_group(b.engine, b.group_name))
        return JSONResponse({"success": True})

    @r.post("/admin/weights/begin", openapi_extra=body_schema(TransferBeginBody))
    async def weights_begin(request: Request):
        b = await read_model(request, TransferBeginBody)
        return JSONResponse({"out_of_rotation": pool.begin_transfer(b.engines, b.version), "version": pool.version})

    @r.post("/admin/weights/update", openapi_extra=body_schema(TensorBucketBody))
    async def weights_update(request: Request):
        b = await read_model(request, TensorBucketBody)
        if not len(b.names) == len(b.dtypes) == len(b.shapes):
            raise bad_request(f"names ({len(b.names)}), dtypes ({len(b.dtypes)}) and shapes ({len(b.shapes)}) differ in length", param="names")
        batch = TensorBatch(
            tuple(b.names), tuple(b.dtypes), tuple(tuple(s) for s in b.shapes), b.group_name, b.version, first=b.first, final=b.final
        )
        await _on_engine(pool.update_weights_from_distributed(b.engine, batch))
        return JSONResponse({"success": True, "engine": b.engine, "final": b.final})

    @r.post("/admin/weights/commit", openapi_extra=body_schema(TransferCommitBody))
    async def weights_commit(request: Request):
        b = await read_model(request, TransferCommitBody)
        try:
            outcome = pool.commit_transfer(b.version, b.updated, b.failed) or {}
        except ValueError as exc:  # names no engine of this proxy or of the transfer begun here
            raise bad_request(str(exc), param="updated") from exc
        metrics.version.set(pool.version)
        await recompute.refresh()  # which sessions owe values now: their next turns compute them
        if not pool.paused:
            recompute.soon()  # closed sessions now; open ones at their next turn or the next pause
        return JSONResponse(
            {"version": pool.version, "out_of_rotation": pool.status().get("out_of_rotation", {}), "ignored": outcome.get("ignored", [])}
        )

    @r.get("/admin/status")
    async def status():
        stats = await asyncio.to_thread(store.stats)
        owed = await asyncio.to_thread(store.turns.owed_count, pool.version)
        pool_status = pool.status()
        return JSONResponse(
            {
                "version": pool.version,
                "paused": pool.paused,
                "inflight": pool_status.get("in_flight", 0),
                "engines": pool_status,
                "store": stats,
                "owed_recompute_turns": owed,
                "expired_pauses": guard.expired,
                "max_pause_s": guard.max_pause_s,
                # engines whose weight transfer began and did not complete: no traffic
                "out_of_rotation": pool_status.get("out_of_rotation", {}),
                "expired_transfers": pool_status.get("expired_transfers", 0),
            }
        )

    return r
