"""Admin routes: the weight-update protocol (pause, update weights or version, resume) and status."""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Request
from pydantic import Field

from engines.types import EngineError

from ..errors import APIError, bad_request, from_engine_error
from ..metrics import Metrics
from ..session import RecomputeScheduler
from ..store import Store
from .jsonio import JSONResponse, body_schema, read_model
from .models import UpdateWeightsBody, VersionBody

log = logging.getLogger("splice.admin")


class FleetUpdateWeightsBody(UpdateWeightsBody):
    # Fleet publish (docs/fleet.md): load only on these engines (ids from /admin/status
    # ``engines.engine_replicas``); the other proxies sharing them only learn the version.
    engines: list[str] | None = Field(default=None, max_length=4096)


class FleetVersionBody(VersionBody):
    # where the weights of ``version`` live on the engines: what a replica that comes back
    # stale is brought up to
    model_path: str | None = Field(default=None, max_length=4096)


async def _engine(coro):
    try:
        return await coro
    except EngineError as exc:
        raise from_engine_error(exc) from exc


class _ClientGone(Exception):
    """The caller of a pause disconnected (gave up) before it took effect."""


async def _disconnect(request: Request) -> None:
    """Returns once the client has gone (the body, if any, is read first)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


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
        gone = asyncio.create_task(_disconnect(request))
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
            }
        )

    return r
