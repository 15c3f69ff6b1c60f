"""Trainer- and harness-facing routes: sessions with their turns, rewards, trajectory pull / ack."""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response, StreamingResponse

from engines.types import EngineError

from ..errors import APIError
from ..session import RecomputeScheduler
from ..settings import Settings
from ..store import Conflict, NotFound, Store
from ..store.columns import ARROW_STREAM, ipc_stream
from ..store.samples import SAMPLE_SCHEMA_VERSION
from ..store.staleness import StaleFilter, is_stale
from .jsonio import JSONResponse, body_schema, dumps, read_model
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
        since, limit = _since_and_limit(q)
        closed = {"open": False, "closed": True}.get(status or "")
        try:
            page = await asyncio.to_thread(
                store.sessions.list, group_id=q.get("group_id") or None, closed=closed, since=since,
                cursor=q.get("cursor") or None, limit=limit,
            )  # fmt: skip
        except ValueError:
            raise APIError(400, "cursor is not one this proxy issued", code="invalid_value", param="cursor") from None
        return JSONResponse({"object": "list", "data": page.sessions, "has_more": page.next_cursor is not None, "next_cursor": page.next_cursor})

    @r.get("/v1/images/{image_hash}")
    async def get_image(image_hash: str):
        """A stored image's bytes as the agent sent them (``sha256`` of its decoded pixels, as in a
        sample's ``images``); immutable, so cacheable forever."""
        if len(image_hash) != 64 or any(ch not in "0123456789abcdef" for ch in image_hash):
            raise APIError(400, "an image hash is 64 lowercase hex digits (sha256)", code="invalid_value", param="image_hash")
        im = await asyncio.to_thread(store.images.get, image_hash)
        if im is None:
            raise APIError(404, f"No image with hash '{image_hash}'.", code="image_not_found")
        headers = {
            "cache-control": "public, max-age=31536000, immutable",
            "etag": f'"{image_hash}"',
            "x-splice-image-grid": ",".join(map(str, im.grid_thw)),
            "x-splice-image-size": f"{im.width}x{im.height}",
        }
        return Response(im.data, media_type=im.mime, headers=headers)

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
        """Lease ready samples; JSON, or an Arrow IPC stream when ``Accept`` names it (docs/samples.md)."""
        body = await read_model(request, PullBody)
        deadline = time.monotonic() + body.wait_s
        dropped = 0
        while True:
            try:  # R2's pull deadline: rewarded sessions' owed values first (bounded wait)
                await recompute.settle(closed_only=True)
            except EngineError as exc:
                log.warning("recompute before pull failed: %s", exc)
            stale = StaleFilter(recompute.min_version)
            lease = await _in_pull_thread(lambda: store.pool.lease(body.max_samples, settings.lease_timeout_s, keep=stale.keep))
            dropped += lease.dropped
            if lease.lease_id is not None or time.monotonic() >= deadline:
                break
            await asyncio.sleep(min(0.25, max(0.0, deadline - time.monotonic())))
        if dropped:
            recompute.metrics.dropped_stale.inc(dropped)
            log.info("pull dropped %d samples with loss tokens older than v%s (--max-staleness)", dropped, recompute.min_version)
        dropped_stale = dropped
        min_version = stale.min_version  # the bound the lease counted by; send by the same one
        samples = store.pool.samples(lease.session_ids, keep=lambda smp: not is_stale(smp, min_version))  # one session at a time, as sent
        if wants_arrow(request.headers.get("accept")):
            return _arrow(samples, lease_id=lease.lease_id, dropped_stale=dropped_stale, n_samples=lease.n_samples)
        return _json({"schema_version": SAMPLE_SCHEMA_VERSION, "lease_id": lease.lease_id, "dropped_stale": dropped_stale}, samples)

    @r.get("/v1/trajectories/samples")
    async def samples_page(request: Request):
        """Rewarded sessions' samples without leasing anything (``splice export``):
        ``?since=<unix s>&acked=true&limit=<sessions>&cursor=``; JSON or Arrow like the pull."""
        q = request.query_params
        since, limit = _since_and_limit(q)
        acked = (q.get("acked") or "false").lower()
        if acked not in ("true", "false", "1", "0"):
            raise APIError(400, "acked must be true or false", code="invalid_value", param="acked")
        after = _decode_cursor(q.get("cursor"))
        rows = await _in_pull_thread(lambda: store.pool.rewarded(since=since, acked=acked in ("true", "1"), after=after, limit=limit + 1))
        more = len(rows) > limit
        rows = rows[:limit]
        cursor = _encode_cursor(rows[-1]) if more else None
        samples = store.pool.samples([sid for _, sid in rows])
        if wants_arrow(request.headers.get("accept")):
            return _arrow(samples, next_cursor=cursor)
        return _json({"schema_version": SAMPLE_SCHEMA_VERSION, "has_more": more, "next_cursor": cursor}, samples)

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


def _since_and_limit(q) -> tuple[float | None, int]:
    """``since`` (unix seconds, optional) and ``limit`` (1..1000, default 100) of a listing."""
    try:
        since = float(q["since"]) if q.get("since") else None
        limit = int(q.get("limit") or 100)
    except ValueError:
        raise APIError(400, "since must be a number (unix seconds) and limit an integer", code="invalid_value") from None
    if not 1 <= limit <= 1000:
        raise APIError(400, "limit must be between 1 and 1000", code="invalid_value", param="limit")
    return since, limit


def wants_arrow(accept: str | None) -> bool:
    """Whether ``Accept`` names the Arrow stream type (with a non-zero ``q``)."""
    for part in (accept or "").split(","):
        media, *params = (x.strip() for x in part.split(";"))
        if media.lower() == ARROW_STREAM:
            q = next((p.partition("=")[2] for p in params if p.lower().startswith("q=")), "1")
            try:
                return float(q) > 0
            except ValueError:
                return True
    return False


# Samples are assembled and encoded on one thread of their own: off the event loop, and always
# the same thread, so the allocator reuses one arena instead of growing one per worker thread
# that happens to run a pull (measured: tens of MB per new thread for a 100k-token sample).
_PULL_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="splice-pull")


async def _in_pull_thread(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(_PULL_THREAD, fn, *args)


async def _chunks_from_pull_thread(chunks: Iterator[bytes]) -> AsyncIterator[bytes]:
    done = object()
    while (chunk := await _in_pull_thread(next, chunks, done)) is not done:
        yield chunk


def _arrow(samples, **metadata) -> StreamingResponse:
    """Streamed record batch by record batch: memory stays at one chunk, not the lease."""
    headers = {"X-Splice-Schema-Version": str(SAMPLE_SCHEMA_VERSION)}
    if metadata.get("lease_id"):
        headers["X-Splice-Lease-Id"] = str(metadata["lease_id"])
    return StreamingResponse(_chunks_from_pull_thread(ipc_stream(samples, **metadata)), media_type=ARROW_STREAM, headers=headers)


def _json_pieces(head: dict, samples) -> Iterator[bytes]:
    """``head`` with a ``samples`` list appended, one sample at a time."""
    yield dumps(head)[:-1] + b',"samples":['
    for i, sample in enumerate(samples):
        yield (b"," if i else b"") + dumps(sample.to_json())
    yield b"]}"


def _json(head: dict, samples) -> StreamingResponse:
    """The JSON answer, streamed sample by sample like the Arrow one (a lease of long samples
    would otherwise sit in memory whole, as text)."""
    return StreamingResponse(_chunks_from_pull_thread(_json_pieces(head, samples)), media_type="application/json")


def _encode_cursor(row: tuple[float, str]) -> str:
    return base64.urlsafe_b64encode(orjson.dumps(list(row))).decode()


def _decode_cursor(cursor: str | None) -> tuple[float, str] | None:
    if not cursor:
        return None
    try:
        at, sid = orjson.loads(base64.urlsafe_b64decode(cursor.encode()))
        return float(at), str(sid)
    except Exception:  # noqa: BLE001 - any malformed cursor is the client's error
        raise APIError(400, "cursor is not one this proxy issued", code="invalid_value", param="cursor") from None
