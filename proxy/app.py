"""The FastAPI app: wiring of tokenization, engines, store, front ends and trainer routes."""

from __future__ import annotations

import logging
import os
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response

from .json_response import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tokenization import ChatFormat

from .guard import Guard
from .errors import APIError, error_body
from .metrics import Metrics
from .sessions import TurnRunner
from .settings import Settings
from .store import Store
from .training_api import Trainer, training_router

log = logging.getLogger("splice.app")


def create_app(settings: Settings, *, fmt: ChatFormat, pool, store: Store | None = None) -> FastAPI:
    """Build the proxy app around an engine pool and a chat format (the CLI builds those)."""
    metrics = Metrics()
    store = store or Store(settings.store)
    runner = TurnRunner(fmt, pool, store, settings, metrics)
    trainer = Trainer(store, pool, metrics, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await pool.start()
        metrics.version.set(pool.version)
        try:
            yield
        finally:
            await runner.drain()
            await pool.close()
            store.close()

    app = FastAPI(title="Splice", lifespan=lifespan, default_response_class=JSONResponse)
    app.state.runner = runner
    app.state.store = store
    app.state.pool = pool
    app.state.metrics = metrics
    app.state.settings = settings

    from .chat_api import chat_router
    from .responses_api import responses_router

    app.include_router(responses_router(runner, store))
    app.include_router(chat_router(runner))
    app.include_router(training_router(trainer))

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return JSONResponse(error_body(400, f"{where}: {first.get('msg', 'invalid request')}", code="invalid_request", param=where or None), status_code=400)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}", code="internal_error"), status_code=500)

    app.add_middleware(Guard, settings=settings, metrics=metrics)

    @app.get("/health")
    async def health():
        return {"status": "ok", "version": pool.version, "paused": pool.paused}

    @app.get("/metrics")
    async def prometheus():
        try:
            metrics.store_bytes.set(os.path.getsize(settings.store))
        except OSError:
            pass
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [{"id": settings.model_name, "object": "model", "created": 0, "owned_by": "splice"}],
        }

    return app

