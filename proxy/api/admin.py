"""Admin routes: the weight-update protocol (pause, update weights or version, resume) and status."""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Request
from pydantic import Field

from engines.types import EngineError

from ..errors import bad_request, from_engine_error
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


def admin_router(store: Store, pool, recompute: RecomputeScheduler, metrics: Metrics) -> APIRouter:
    r = APIRouter()

    @r.post("/admin/recompute")
    async def recompute_owed():
        # A fleet publish runs this on every proxy before any proxy pauses: once one proxy has
        # paused the shared engines, another proxy's recompute would wait for them to continue.
        report = await _engine(recompute.settle())
        return JSONResponse({"recomputed_tokens": report.tokens, "version": pool.version, "recompute": report.to_dict()})

    @r.post("/admin/pause")
    async def pause(request: Request):
        # R2's deadline: owed values are settled first, waiting at most --recompute-deadline-s;
        # what is not done then is counted missing and the pause goes ahead (never blocked).
        run = request.query_params.get("recompute", "true").lower() not in ("false", "0", "no")
        try:
            report = await recompute.before_pause(recompute=run)
        except EngineError as exc:
            log.warning("recompute before pause failed: %s", exc)
            report = None
        await _engine(pool.pause())
        body = {"paused": True, "version": pool.version, "recomputed_tokens": report.tokens if report else 0}
        if report is not None:
            body["recompute"] = report.to_dict()
        return JSONResponse(body)

    @r.post("/admin/update_weights", openapi_extra=body_schema(FleetUpdateWeightsBody))
    async def update_weights(request: Request):
        body = await read_model(request, FleetUpdateWeightsBody)
        # model_path is a path on the engine's filesystem: passed through, the engine decides.
        kw = {} if body.engines is None else {"engines": body.engines}
        try:
            report = await _engine(pool.update_weights(body.model_path, body.version, **kw))
        except ValueError as exc:  # an engine id this proxy does not have
            raise bad_request(str(exc), param="engines") from exc
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
            }
        )

    return r
