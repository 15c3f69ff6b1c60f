"""The viewer's routes: the page shell and its assets (no data, open), and small read-only JSON
endpoints under ``/ui/api/`` (the session-reading credential, see ``proxy.auth``)."""

from __future__ import annotations

import asyncio
from importlib import resources

from fastapi import APIRouter, Request
from starlette.responses import Response

from ..api.jsonio import JSONResponse
from ..errors import APIError
from ..session.roles import ROLES
from . import queries
from .now import WeightLog, now
from .view import MAX_PAGE, Pieces, Segmenter, ViewCache, overview, page, summary

ASSETS = {
    "app.js": "text/javascript; charset=utf-8",
    "app.css": "text/css; charset=utf-8",
}
# The page may talk to this proxy only: no script, style, image or connection elsewhere.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' blob: data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def _asset(name: str) -> bytes:
    return resources.files("proxy.ui").joinpath("static", name).read_bytes()


def _bool(q, name: str) -> bool | None:
    v = (q.get(name) or "").lower()
    if v in ("", "any"):
        return None
    if v in ("true", "1", "yes"):
        return True
    if v in ("false", "0", "no"):
        return False
    raise APIError(400, f"{name} must be true, false or any", code="invalid_value", param=name)


def _int(q, name: str, default: int | None = None, lo: int = -(2**31), hi: int = 2**31 - 1) -> int | None:
    v = q.get(name)
    if v in (None, ""):
        return default
    try:
        x = int(v)
    except ValueError:
        raise APIError(400, f"{name} must be an integer", code="invalid_value", param=name) from None
    if not lo <= x <= hi:
        raise APIError(400, f"{name} must be between {lo} and {hi}", code="invalid_value", param=name)
    return x


def _role(q) -> str | None:
    v = (q.get("role") or "").strip().lower()
    if v in ("", "any"):
        return None
    if v not in ROLES:
        raise APIError(400, f"role must be one of {', '.join(ROLES)}, got {v!r}", code="invalid_value", param="role")
    return v


def ui_router(store, pool, fmt, *, weight_log: WeightLog | None = None, metrics=None) -> APIRouter:
    r = APIRouter(include_in_schema=False)
    tokenizer = fmt.tokenizer
    views = ViewCache(store, Segmenter(tokenizer))
    pieces = Pieces(tokenizer)
    shell = _asset("index.html")
    assets = {name: _asset(name) for name in ASSETS}
    headers = {"content-security-policy": CSP, "x-content-type-options": "nosniff", "cache-control": "no-cache"}

    @r.get("/ui")
    @r.get("/ui/")
    async def index():
        return Response(shell, media_type="text/html; charset=utf-8", headers=headers)

    @r.get("/ui/static/{name}")
    async def asset(name: str):
        if name not in assets:
            raise APIError(404, "Not found.", code="not_found")
        return Response(assets[name], media_type=ASSETS[name], headers=headers)

    @r.get("/ui/api/sessions")
    async def sessions(request: Request):
        q = request.query_params
        f = queries.SessionFilter(
            group_id=q.get("group") or None,
            role=_role(q),
            rewarded=_bool(q, "rewarded"),
            fork_reason=q.get("fork_reason") or None,
            has_images=_bool(q, "has_images"),
            engine=q.get("engine") or None,
            version_min=_int(q, "version_min"),
            version_max=_int(q, "version_max"),
            search=q.get("q") or None,
        )
        limit = _int(q, "limit", 50, 1, queries.MAX_LIMIT)
        try:
            body = await asyncio.to_thread(queries.list_sessions, store.db, f, version=pool.version,
                                           cursor=q.get("cursor") or None, limit=limit)  # fmt: skip
        except ValueError:
            raise APIError(400, "cursor is not one this proxy issued", code="invalid_value", param="cursor") from None
        body["version"] = pool.version
        return JSONResponse(body)

    @r.get("/ui/api/choices")
    async def choices():
        reasons = await asyncio.to_thread(queries.fork_reasons, store.db)
        engines = await asyncio.to_thread(queries.engines, store.db)
        return JSONResponse({"fork_reasons": reasons, "engines": engines, "roles": list(ROLES), "version": pool.version})

    async def _view(session_id: str):
        view = await asyncio.to_thread(views.get, session_id)
        if view is None:
            raise APIError(404, f"No session with id '{session_id}'.", code="session_not_found")
        return view

    @r.get("/ui/api/session")
    async def session(request: Request):
        sid = request.query_params.get("id") or ""
        view = await _view(sid)
        return JSONResponse(summary(view, pool.version))

    async def _view_sample(q):
        """The session named by ``id`` and the index of its sample named by ``sample`` (404 past the end)."""
        view = await _view(q.get("id") or "")
        k = _int(q, "sample", 0, 0)
        if k >= len(view.samples):
            raise APIError(404, f"the session has {len(view.samples)} samples", code="sample_not_found", param="sample")
        return view, k

    @r.get("/ui/api/tokens")
    async def tokens(request: Request):
        q = request.query_params
        view, k = await _view_sample(q)
        start = _int(q, "start", 0, 0)
        count = _int(q, "count", 2048, 1, MAX_PAGE)
        return JSONResponse(await asyncio.to_thread(page, view, pieces, k, start, count))

    @r.get("/ui/api/overview")
    async def overview_of(request: Request):
        q = request.query_params
        view, k = await _view_sample(q)
        return JSONResponse(await asyncio.to_thread(overview, view, k, _int(q, "buckets", 600, 1, 4000)))

    @r.get("/ui/api/images/{image_hash}")
    async def image(image_hash: str):
        if len(image_hash) != 64 or any(ch not in "0123456789abcdef" for ch in image_hash):
            raise APIError(400, "an image hash is 64 lowercase hex digits (sha256)", code="invalid_value", param="image_hash")
        im = await asyncio.to_thread(store.images.get, image_hash)
        if im is None:
            raise APIError(404, f"No image with hash '{image_hash}'.", code="image_not_found")
        return Response(im.data, media_type=im.mime, headers={"cache-control": "private, max-age=31536000, immutable"})

    @r.get("/ui/api/now")
    async def now_page():
        owed = await asyncio.to_thread(store.turns.owed_count, pool.version)
        stats = await asyncio.to_thread(store.stats)
        body = now(pool, owed, weight_log, metrics)
        body["store"] = {k: stats[k] for k in ("sessions", "sessions_open", "rewards_pending", "turns", "tokens")}
        return JSONResponse(body)

    return r
