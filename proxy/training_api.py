"""Routes for trainers and harnesses: sessions, rewards, trajectory pull/ack, admin."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

from fastapi import APIRouter, Request
from .json_response import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engines.types import EngineError

from .errors import APIError, bad_request
from .recompute import recompute_owed
from .store import Conflict, NotFound

log = logging.getLogger("splice.training")


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class RewardBody(_Body):
    reward: float = Field(allow_inf_nan=False)  # NaN or inf would poison every advantage in its group


class PullBody(_Body):
    max_samples: int = Field(default=64, ge=1, le=100_000)
    wait_s: float = Field(default=0.0, ge=0.0, le=3600.0)


class AckBody(_Body):
    lease_id: str


class UpdateWeightsBody(_Body):
    model_path: str
    version: int = Field(ge=0)


class VersionBody(_Body):
    version: int = Field(ge=0)


async def parse(request: Request, model: type[BaseModel]) -> Any:
    try:
        data = await request.json()
    except Exception:
        raise bad_request("request body must be JSON")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ()))
        raise bad_request(f"{where}: {first.get('msg')}", param=where or None)


class Trainer:
    """State shared by the trainer-facing routes: the store, the engine pool, recompute."""

    def __init__(self, store, pool, metrics, settings):
        self.store = store
        self.pool = pool
        self.metrics = metrics
        self.settings = settings
        self._recompute_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()

    async def recompute(self) -> int:
        """R2: proximal logprobs for tokens owed one under the current version."""
        if self.pool.paused:
            return 0
        async with self._recompute_lock:
            n = await recompute_owed(self.store, self.pool, self.pool.version)
        if n:
            self.metrics.recomputed.inc(n)
        return n

    def recompute_soon(self) -> None:
        task = asyncio.get_running_loop().create_task(self._safe_recompute())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _safe_recompute(self) -> None:
        try:
            await self.recompute()
        except Exception:
            log.exception("recompute after weight update failed; values stay owed")


def training_router(tr: Trainer) -> APIRouter:
    r = APIRouter()
    store = tr.store

    @r.get("/v1/sessions/{session_id}")
    async def get_session(session_id: str):
        session = await asyncio.to_thread(store.get_session, session_id)
        if session is None:
            raise APIError(404, f"No session with id '{session_id}'.", code="session_not_found")
        turns = await asyncio.to_thread(store.list_turns, session_id)
        forks: dict[str, int] = {}
        for t in turns:
            if t.fork_reason:
                forks[t.fork_reason] = forks.get(t.fork_reason, 0) + 1
        body = session.to_dict()
        body.update(
            {
                "object": "splice.session",
                "turns": [t.to_dict() for t in turns],
                "spliced_turns": sum(t.spliced for t in turns),
                "forks": forks,
                "drift_avoided": sum(bool(t.drift) for t in turns),
            }
        )
        return JSONResponse(body)

    @r.post("/v1/sessions/{session_id}/reward")
    async def reward(session_id: str, request: Request):
        body = await parse(request, RewardBody)
        try:
            session = await asyncio.to_thread(store.set_reward, session_id, body.reward)
        except NotFound:
            raise APIError(404, f"No session with id '{session_id}'.", code="session_not_found")
        except Conflict as exc:
            raise APIError(409, str(exc), code="session_closed")
        return JSONResponse(session.to_dict())

    @r.post("/v1/trajectories/pull")
    async def pull(request: Request):
        body = await parse(request, PullBody)
        deadline = time.monotonic() + body.wait_s
        while True:
            try:
                await tr.recompute()  # never hand out a token owed a value it could get now
            except EngineError as exc:
                log.warning("recompute before pull failed: %s", exc)
            lease_id, samples = await asyncio.to_thread(store.pull, body.max_samples, tr.settings.lease_timeout_s)
            if samples or time.monotonic() >= deadline:
                break
            await asyncio.sleep(min(0.25, max(0.0, deadline - time.monotonic())))
        return JSONResponse({"lease_id": lease_id if samples else None, "samples": samples})

    @r.post("/v1/trajectories/ack")
    async def ack(request: Request):
        body = await parse(request, AckBody)
        try:
            out = await asyncio.to_thread(store.ack, body.lease_id)
        except NotFound as exc:
            raise APIError(404, str(exc), code="lease_not_found")
        except Conflict as exc:
            raise APIError(409, str(exc), code="lease_expired")
        return JSONResponse({"lease_id": body.lease_id, "acked": True, "detail": _plain(out)})

    @r.post("/admin/pause")
    async def pause():
        owed = 0
        try:
            owed = await tr.recompute()
        except EngineError as exc:
            log.warning("recompute before pause failed: %s", exc)
        await _engine(tr.pool.pause())
        return JSONResponse({"paused": True, "version": tr.pool.version, "recomputed_tokens": owed})

    @r.post("/admin/update_weights")
    async def update_weights(request: Request):
        body = await parse(request, UpdateWeightsBody)
        if not os.path.exists(body.model_path):
            raise bad_request(f"model_path '{body.model_path}' does not exist on this host", param="model_path")
        await _engine(tr.pool.update_weights(body.model_path, body.version))
        tr.metrics.version.set(tr.pool.version)
        if not tr.pool.paused:
            tr.recompute_soon()
        return JSONResponse({"success": True, "version": tr.pool.version})

    @r.post("/admin/version")
    async def set_version(request: Request):
        body = await parse(request, VersionBody)
        tr.pool.set_version(body.version)
        tr.metrics.version.set(body.version)
        if not tr.pool.paused:
            tr.recompute_soon()
        return JSONResponse({"version": tr.pool.version})

    @r.post("/admin/resume")
    async def resume():
        await _engine(tr.pool.resume())
        tr.recompute_soon()
        return JSONResponse({"paused": False, "version": tr.pool.version})

    @r.get("/admin/status")
    async def status():
        stats = await asyncio.to_thread(store.stats)
        owed = await asyncio.to_thread(store.owed_turn_count, tr.pool.version)
        pool_status = tr.pool.status()
        return JSONResponse(
            {
                "version": tr.pool.version,
                "paused": tr.pool.paused,
                "inflight": pool_status.get("in_flight", 0),
                "engines": pool_status,
                "store": _plain(stats),
                "owed_recompute_turns": owed,
            }
        )

    return r


async def _engine(coro):
    try:
        return await coro
    except EngineError as exc:
        raise APIError(exc.status_code, f"engine error: {exc}", code=exc.code)


def _plain(x):
    if hasattr(x, "__dataclass_fields__"):
        from dataclasses import asdict

        return asdict(x)
    return x
