"""Admin routes: the weight-update protocol (pause, update weights or version, resume) and status."""

from __future__ import annotations

import asyncio
import logging
from typing import Literal

from fastapi import APIRouter, Request
from pydantic import Field

from engines.types import EngineError
from engines.weight_transfer import TensorBatch, WeightGroup

from ..errors import bad_request, from_engine_error
from ..metrics import Metrics
from ..session import RecomputeScheduler
from ..store import Store
from .jsonio import JSONResponse, body_schema, read_model
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


def admin_router(store: Store, pool, recompute: RecomputeScheduler, metrics: Metrics) -> APIRouter:
    r = APIRouter()

    @r.post("/admin/recompute")
    async def recompute_owed():
        # A fleet publish runs this on every proxy before any proxy pauses: once one proxy has
        # paused the shared engines, another proxy's recompute would wait for them to continue.
        return JSONResponse({"recomputed_tokens": await _engine(recompute.run()), "version": pool.version})

    @r.post("/admin/pause")
    async def pause(request: Request):
        owed = 0
        if request.query_params.get("recompute", "true").lower() not in ("false", "0", "no"):
            try:
                owed = await recompute.run()
            except EngineError as exc:
                log.warning("recompute before pause failed: %s", exc)
        await _engine(pool.pause())
        return JSONResponse({"paused": True, "version": pool.version, "recomputed_tokens": owed})

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
        if not pool.paused:
            recompute.soon()
        return JSONResponse({"success": True, "version": pool.version, **(report or {})})

    @r.post("/admin/version", openapi_extra=body_schema(FleetVersionBody))
    async def set_version(request: Request):
        body = await read_model(request, FleetVersionBody)
        await _engine(pool.announce_version(body.version, model_path=body.model_path or None))
        metrics.version.set(body.version)
        if not pool.paused:
            recompute.soon()
        return JSONResponse({"version": pool.version})

    @r.post("/admin/resume")
    async def resume():
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
        await _on_engine(pool.init_weights_group(b.engine, group))
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
        pool.commit_transfer(b.version, b.updated, b.failed)
        metrics.version.set(pool.version)
        if not pool.paused:
            recompute.soon()
        return JSONResponse({"version": pool.version, "out_of_rotation": pool.status().get("out_of_rotation", {})})

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
                # engines whose weight transfer began and did not complete: no traffic
                "out_of_rotation": pool_status.get("out_of_rotation", {}),
            }
        )

    return r
