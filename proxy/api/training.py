"""Trainer- and harness-facing routes: sessions with their turns, rewards, trajectory pull / ack."""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import APIRouter, Request

from engines.types import EngineError

from ..errors import APIError
from ..session import RecomputeScheduler
from ..settings import Settings
from ..store import Conflict, NotFound, Store
from .jsonio import JSONResponse, read_model
from .models import AckBody, PullBody, RewardBody

log = logging.getLogger("splice.training")


def training_router(store: Store, recompute: RecomputeScheduler, settings: Settings) -> APIRouter:
    r = APIRouter()

    @r.get("/v1/sessions/{session_id}")
    async def get_session(session_id: str):
        session = store.sessions.get(session_id)
        if session is None:
            raise APIError(404, f"No session with id '{session_id}'.", code="session_not_found")
        turns = await asyncio.to_thread(store.turns.list, session_id)
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
        body = await read_model(request, RewardBody)
        try:
            session = store.sessions.set_reward(session_id, body.reward)
        except NotFound:
            raise APIError(404, f"No session with id '{session_id}'.", code="session_not_found")
        except Conflict as exc:
            raise APIError(409, str(exc), code="session_closed")
        return JSONResponse(session.to_dict())

    @r.post("/v1/trajectories/pull")
    async def pull(request: Request):
        body = await read_model(request, PullBody)
        deadline = time.monotonic() + body.wait_s
        while True:
            try:
                await recompute.run()  # never hand out a token owed a value it could get now
            except EngineError as exc:
                log.warning("recompute before pull failed: %s", exc)
            lease_id, samples = await asyncio.to_thread(store.pool.pull, body.max_samples, settings.lease_timeout_s)
            if samples or time.monotonic() >= deadline:
                break
            await asyncio.sleep(min(0.25, max(0.0, deadline - time.monotonic())))
        return JSONResponse({"lease_id": lease_id if samples else None, "samples": samples})

    @r.post("/v1/trajectories/ack")
    async def ack(request: Request):
        body = await read_model(request, AckBody)
        try:
            store.pool.ack(body.lease_id)
        except NotFound as exc:
            raise APIError(404, str(exc), code="lease_not_found")
        except Conflict as exc:
            raise APIError(409, str(exc), code="lease_expired")
        return JSONResponse({"lease_id": body.lease_id, "acked": True, "detail": None})

    return r
