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
from .jsonio import JSONResponse, body_schema, read_model
from .models import AckBody, PullBody, RewardBody

log = logging.getLogger("splice.training")


def training_router(store: Store, recompute: RecomputeScheduler, settings: Settings) -> APIRouter:
    r = APIRouter()

    @r.get("/v1/sessions")
    async def list_sessions(request: Request):
        """Sessions oldest first: ``?group_id=&status=open|closed&since=<unix s>&limit=&cursor=``."""
        q = request.query_params
        status = q.get("status")
        if status not in (None, "", "open", "closed", "all"):
            raise APIError(400, f"status must be open, closed or all, got {status!r}", code="invalid_value", param="status")
        try:
            since = float(q["since"]) if q.get("since") else None
            limit = int(q.get("limit") or 100)
        except ValueError:
            raise APIError(400, "since must be a number (unix seconds) and limit an integer", code="invalid_value") from None
        if not 1 <= limit <= 1000:
            raise APIError(400, "limit must be between 1 and 1000", code="invalid_value", param="limit")
        closed = {"open": False, "closed": True}.get(status or "")
        try:
            page = await asyncio.to_thread(
                store.sessions.list, group_id=q.get("group_id") or None, closed=closed, since=since,
                cursor=q.get("cursor") or None, limit=limit,
            )  # fmt: skip
        except ValueError:
            raise APIError(400, "cursor is not one this proxy issued", code="invalid_value", param="cursor") from None
        return JSONResponse({"object": "list", "data": page.sessions, "has_more": page.next_cursor is not None, "next_cursor": page.next_cursor})

    @r.get("/v1/sessions/{session_id:path}")  # ids may hold "/" (sent as %2F or as is)
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

    @r.post("/v1/sessions/{session_id:path}/reward", openapi_extra=body_schema(RewardBody))
    async def reward(session_id: str, request: Request):
        body = await read_model(request, RewardBody)
        try:
            session = store.sessions.set_reward(session_id, body.reward)
        except NotFound:
            raise APIError(404, f"No session with id '{session_id}'.", code="session_not_found")
        except Conflict as exc:
            raise APIError(409, str(exc), code="session_closed")
        return JSONResponse(session.to_dict())

    @r.post("/v1/trajectories/pull", openapi_extra=body_schema(PullBody))
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

    @r.post("/v1/trajectories/ack", openapi_extra=body_schema(AckBody))
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
