"""The streaming skeleton every dialect shares: a turn running in the background, SSE framing,
and the mapping of failures to API errors.

``TurnStream`` runs one turn in a background task and hands its output ids to the front end
as the engine produces them. It does not start the HTTP response until the first ids arrive
(or the turn ends), so a request that fails before generating anything — bad input, a prompt
that does not fit — gets an ordinary JSON error with the right status instead of a stream.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator

from fastapi.responses import StreamingResponse

from engines.types import EngineError

from ..errors import APIError, from_engine_error
from ..session.turn import TurnRequest, TurnResult
from .jsonio import dumps

log = logging.getLogger("splice.frontend")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "Connection": "keep-alive"}
DONE = b"data: [DONE]\n\n"


def sse_event(event: str, data: dict[str, Any]) -> bytes:
    """One SSE frame with an ``event:`` line (Responses API style)."""
    return b"event: " + event.encode() + b"\ndata: " + dumps(data) + b"\n\n"


def sse_data(data: dict[str, Any]) -> bytes:
    """One SSE frame with only ``data:`` (Chat Completions style)."""
    return b"data: " + dumps(data) + b"\n\n"


def streaming_response(body: AsyncIterator[bytes], headers: dict[str, str] | None = None) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream", headers={**SSE_HEADERS, **(headers or {})})


def to_api_error(exc: BaseException) -> APIError:
    """Map a failure of the session layer / engines to an OpenAI-shaped error."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineError):
        return from_engine_error(exc)
    log.exception("turn failed", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")


async def run_turn(runner, req: TurnRequest) -> TurnResult:
    """Run a turn without streaming; every failure becomes an ``APIError``."""
    try:
        return await runner.run(req)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise to_api_error(exc) from exc


_END = object()


class TurnStream:
    """A turn running in the background; iterate it for batches of new output ids."""

    def __init__(self, runner, req: TurnRequest):
        self.req = req
        self._queue: asyncio.Queue = asyncio.Queue()
        self._first: list[int] | object | None = None
        self.task: asyncio.Task = asyncio.create_task(runner.run(req, on_tokens=self._on_tokens))
        self.task.add_done_callback(lambda _t: self._queue.put_nowait(_END))

    async def _on_tokens(self, ids: list[int], _logprobs: list[float]) -> None:
        if ids:
            self._queue.put_nowait(list(ids))

    async def start(self) -> None:
        """Wait for the first ids or the end of the turn; raise ``APIError`` if it failed first."""
        try:
            self._first = await self._queue.get()
        except asyncio.CancelledError:
            self.cancel()
            raise
        if self._first is _END:
            self._first = None
            self._queue.put_nowait(_END)
            self.result()  # raises if the turn failed

    async def batches(self) -> AsyncIterator[list[int]]:
        if self._first is not None:
            first, self._first = self._first, None
            if first is _END:
                return
            yield first  # type: ignore[misc]
        while True:
            item = await self._queue.get()
            if item is _END:
                self._queue.put_nowait(_END)
                return
            yield item

    def result(self) -> TurnResult:
        """The finished turn's result; raises ``APIError`` if it failed."""
        exc = self.task.exception()
        if exc is not None:
            raise to_api_error(exc) from exc
        return self.task.result()

    def headers(self) -> dict[str, str]:
        """Where the turn landed; known once it started (the session layer planned it)."""
        out = {"X-Splice-Turn-Id": self.req.turn_id}
        if self.req.session_resolved:
            out["X-Splice-Session-Id"] = self.req.session_resolved
        return out

    def cancel(self) -> None:
        if not self.task.done():
            self.task.cancel()
