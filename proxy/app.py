"""The FastAPI app: wiring of tokenization, engines, store, session layer and routes."""

from __future__ import annotations

import gc
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from tokenization import ChatFormat

from .api.admin import admin_router
from .api.chat import chat_router
from .api.history_memo import HistoryMemo
from .api.images import ImageInput
from .api.jsonio import JSONResponse
from .api.messages import messages_router
from .api.messages_errors import anthropic_error
from .api.responses import responses_router
from .api.training import training_router
from .errors import APIError, error_body
from .guard import ClientGone, Guard
from .metrics import Metrics
from .session import RecomputeScheduler, TurnRunner
from .session.drift import DriftChecker
from .session.sampling import SamplingPolicy
from .settings import Settings
from .store import Store

log = logging.getLogger("splice.app")


def _anthropic_path(path: str) -> bool:
    """Routes under ``/v1/messages`` answer in Anthropic's error shape, unknown ones included."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


TURN_PATHS = ("/v1/chat/completions", "/v1/responses", "/v1/messages")


def _turn_endpoints(routers) -> dict:
    """The agents' turn routes, which the guard calls directly (see ``proxy.guard``)."""
    found = {
        r.path: r.endpoint for router in routers for r in router.routes
        if isinstance(r, APIRoute) and r.path in TURN_PATHS and "POST" in r.methods
    }  # fmt: skip
    if set(found) != set(TURN_PATHS):
        raise RuntimeError(f"turn routes missing from the routers: {sorted(set(TURN_PATHS) - set(found))}")
    return found


class SpliceApp(FastAPI):
    """FastAPI with the guard (``proxy.guard``) in front of it rather than among its middlewares:
    every request meets the guard first, and a turn goes from there straight to its endpoint,
    past FastAPI's and Starlette's own per-request layers (OpenTelemetry provider checks, the
    server-error and body-limit wrappers), about 3% of a turn's CPU. Other requests go on
    through the whole FastAPI app."""

    guard: Guard | None = None

    async def __call__(self, scope, receive, send) -> None:
        if self.guard is None:
            return await super().__call__(scope, receive, send)
        await self.guard(scope, receive, send)

    async def behind_guard(self, scope, receive, send) -> None:
        await super().__call__(scope, receive, send)


def create_app(settings: Settings, *, fmt: ChatFormat, pool, store: Store | None = None) -> FastAPI:
    """Build the proxy app around an engine pool and a chat format (the CLI builds those)."""
    metrics = Metrics()
    store = store or Store(settings.store)
    store.turns.group.on_flush = metrics.commit_group.observe
    store.pool.train_auxiliary = settings.train_auxiliary
    sampling = SamplingPolicy(
        mode=settings.sampling, temperature=settings.temperature, max_context=settings.max_context,
        default_max_tokens=settings.max_output_tokens,
    )  # fmt: skip
    drift = DriftChecker(fmt, store, metrics, settings.drift_check)
    recompute = RecomputeScheduler(
        store, pool, metrics, deadline_s=settings.recompute_deadline_s, max_staleness=settings.max_staleness
    )
    runner = TurnRunner(
        fmt, pool, store, metrics, sampling=sampling, drift=drift, model_name=settings.model_name, recompute=recompute,
        history_edits=settings.history_edits,
    )  # fmt: skip

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await pool.start()
        sampling.learn_context(pool.info.context_length)
        metrics.version.set(pool.version)
        # Everything made at start-up (the tokenizer's vocabulary, templates, imported modules:
        # millions of objects) lives as long as the server; moved out of the collector's reach,
        # the full collections that turns' allocations trigger no longer walk it each time.
        gc.freeze()
        store.db.read_through_writer()  # the loop commits every turn: its reads find the pages cached
        # A turn frees what it allocates by reference counting (tests/proxy/test_turn_garbage.py),
        # so the collector has nothing to find in it; at the default threshold (700) it still
        # walked every in-flight turn's objects hundreds of times a second under load. It now
        # runs only when tracked objects really accumulate.
        gc.set_threshold(50_000, 20, 10)
        try:
            yield
        finally:
            await runner.drain()
            await recompute.drain()
            await pool.close()
            store.close()

    app = SpliceApp(title="Splice", lifespan=lifespan, default_response_class=JSONResponse)
    app.state.runner = runner
    app.state.recompute = recompute
    app.state.store = store
    app.state.pool = pool
    app.state.metrics = metrics
    app.state.settings = settings
    # Image parts are decoded here, once per distinct image (the cache), into ``ImageInfo``s
    # that the request's ``Message.parts`` carry; a text-only model (no ``fmt.vision``) gets 400s.
    images = ImageInput.from_settings(settings, getattr(fmt, "vision", None))
    app.state.images = images

    app.state.history_memo = memo = HistoryMemo()  # each conversation's last request, converted
    metrics.watch_history_memo(memo)
    turn_routers = (responses_router(runner, store.responses, images, memo), chat_router(runner, images, memo), messages_router(runner, images, memo))
    for router in turn_routers:
        app.include_router(router)
    app.include_router(training_router(store, recompute, settings))
    app.include_router(admin_router(store, pool, recompute, metrics, max_pause_s=settings.max_pause_s))

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        if _anthropic_path(request.url.path):
            status, body = anthropic_error(exc.status, exc.message)
            return JSONResponse(body, status_code=status, headers=exc.headers)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        message = f"{where}: {first.get('msg', 'invalid request')}"
        if _anthropic_path(request.url.path):
            status, anth = anthropic_error(400, message)
            return JSONResponse(anth, status_code=status)
        body = error_body(400, message, code="invalid_request", param=where or None)
        return JSONResponse(body, status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        # unknown routes and methods, in the same shape as every other error of their API
        message = "Not found." if exc.status_code == 404 else str(exc.detail)
        if _anthropic_path(request.url.path):
            status, body = anthropic_error(exc.status_code, message)
            return JSONResponse(body, status_code=status, headers=exc.headers)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return JSONResponse(error_body(exc.status_code, message, code=code), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        # Starlette answers with this, then re-raises to the guard in front (proxy.guard), which
        # logs nothing more for it. A client gone mid-body is no error: the guard logs it as INFO.
        if isinstance(exc, (ClientGone, ClientDisconnect)):
            return Response(status_code=499)
        log.exception("unhandled error on %s", request.url.path)
        message = f"internal error: {type(exc).__name__}"
        if _anthropic_path(request.url.path):
            status, anth = anthropic_error(500, message)
            return JSONResponse(anth, status_code=status)
        return JSONResponse(error_body(500, message, code="internal_error"), status_code=500)

    if settings.ui:  # the session viewer (docs/viewer.md)
        from .ui import mount_ui

        mount_ui(app, store=store, pool=pool, fmt=fmt, metrics=metrics)
    app.guard = Guard(app.behind_guard, settings=settings, metrics=metrics, direct=_turn_endpoints(turn_routers))

    @app.get("/health")
    async def health():
        return {"status": "ok", "version": pool.version, "paused": pool.paused}

    @app.get("/metrics")
    async def prometheus():
        metrics.store_bytes.set(store.db.file_bytes())
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": settings.model_name, "object": "model", "created": 0, "owned_by": "splice"}],
        }

    return app
