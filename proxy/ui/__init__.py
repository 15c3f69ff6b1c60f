"""The session viewer at ``/ui`` (docs/viewer.md): a static page (no build step, no asset
from anywhere but this package) over small read-only JSON endpoints under ``/ui/api/``."""

from __future__ import annotations

from .now import WeightLog
from .routes import ui_router

__all__ = ["WeightLog", "mount_ui", "ui_router"]


def mount_ui(app, *, store, pool, fmt, metrics=None) -> None:
    """Add the viewer's routes and the weight-update log to ``app`` (before it starts)."""
    log = WeightLog(None, pool=pool)

    def middleware(inner):
        log.app = inner
        return log

    app.add_middleware(_Factory, make=middleware)
    app.state.weight_log = log
    app.include_router(ui_router(store, pool, fmt, weight_log=log, metrics=metrics))


class _Factory:
    """``add_middleware`` builds middlewares itself; this hands it the one ``WeightLog``."""

    def __new__(cls, app, *, make):
        return make(app)
