"""The "Now" page's data: engines, version, pause, queue, owed recomputes, recent weight updates.

Weight updates are observed, not driven: ``WeightLog`` is a pass-through ASGI middleware that
notes each admin call that changes weights or the pause state (when it started, how long it
took, its status, the version after it). It reads nothing of the request body and adds no
work to any other route.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass

WATCHED = {
    "/admin/pause": "pause",
    "/admin/resume": "resume",
    "/admin/update_weights": "update_weights",
    "/admin/version": "version",
    "/admin/weights/commit": "weights_commit",
    "/admin/recompute": "recompute",
}


@dataclass
class WeightEvent:
    kind: str
    started_at: float  # unix seconds
    duration_s: float
    status: int
    version: int | None  # the proxy's version once the call returned


class WeightLog:
    """Pass-through ASGI middleware keeping the last ``keep`` weight / pause calls."""

    def __init__(self, app, *, pool, keep: int = 50):
        self.app = app
        self.pool = pool
        self.events: deque[WeightEvent] = deque(maxlen=keep)
        self.paused_since: float | None = None

    async def __call__(self, scope, receive, send):
        kind = WATCHED.get(scope.get("path", "")) if scope["type"] == "http" and scope.get("method") == "POST" else None
        if kind is None:
            return await self.app(scope, receive, send)
        t0, wall = time.perf_counter(), time.time()
        status = 500

        async def watch(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            self.events.append(WeightEvent(kind, wall, time.perf_counter() - t0, status, getattr(self.pool, "version", None)))
            if kind == "pause" and status == 200:
                self.paused_since = wall
            elif kind == "resume" and status == 200:
                self.paused_since = None

    def recent(self) -> list[dict]:
        return [asdict(e) for e in reversed(self.events)]


def now(pool, owed_turns: int, log: WeightLog | None, metrics=None) -> dict:
    """What the engines and the proxy are doing right now."""
    st = pool.status()
    waiting = None
    if metrics is not None:
        try:
            waiting = int(metrics.registry.get_sample_value("splice_admission_waiting") or 0)
        except Exception:  # noqa: BLE001 - a gauge renamed elsewhere must not break the page
            waiting = None
    out_of_rotation = st.get("out_of_rotation", {})
    engines = []
    for r in st.get("engine_replicas", []):
        engines.append(
            {
                "id": r.get("id"),
                "url": r.get("url"),
                "healthy": r.get("healthy"),
                "stale": r.get("stale"),
                "weight_version": r.get("weight_version"),
                "in_rotation": r.get("out_of_rotation") is None and r.get("id") not in out_of_rotation,
                "out_of_rotation": r.get("out_of_rotation"),
            }
        )
    in_flight = {r.get("url"): r.get("in_flight") for r in st.get("replicas", [])}
    for e in engines:
        e["in_flight"] = in_flight.get(e["url"])
    return {
        "version": pool.version,
        "paused": pool.paused,
        "paused_since": log.paused_since if log is not None else None,
        "kind": st.get("kind"),
        "routing": st.get("routing"),
        "in_flight": st.get("in_flight", 0),
        "held": st.get("held", 0),
        "admission_waiting": waiting,
        "owed_recompute_turns": owed_turns,
        "engines": engines,
        "weight_updates": log.recent() if log is not None else [],
        "at": time.time(),
    }
