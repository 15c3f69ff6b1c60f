"""The streaming skeleton every dialect shares: a turn running in the background, SSE framing,
and the mapping of failures to API errors.

``TurnStream`` runs one turn in a background task and hands its output ids to the front end
as the engine produces them. It does not start the HTTP response until the first ids arrive
(or the turn ends), so a request that fails before generating anything — bad input, a prompt
that does not fit — gets an ordinary JSON error with the right status instead of a stream.

Delivery (docs/design.md section 11): the session layer commits a turn before its final body
or event is sent. A turn counts as delivered once that body / event was handed to the
transport. A client that goes away earlier cancels the turn: while it generates, the turn's
task is cancelled (the engine request is aborted, the session lock released, nothing is
committed); if it was already committed, it is marked abandoned and never trained on.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from engines.http import check_token_ids
from engines.types import EngineError

from ..errors import APIError, from_engine_error, internal_error
from ..http_server import DISCONNECT
from ..ids import header_value
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


def streaming_response(
    body: AsyncIterator[bytes], headers: dict[str, str] | None = None, turn: "TurnStream | None" = None
) -> StreamingResponse:
    """An SSE response. With ``turn``, a stream that ends before its last frame was handed to the
    transport (the client went away) abandons the turn."""
    headers = {**SSE_HEADERS, **(headers or {})}
    if turn is None:
        return StreamingResponse(body, media_type="text/event-stream", headers=headers)
    return TurnStreamingResponse(body, turn, headers)


class TurnStreamingResponse(StreamingResponse):
    """Knows whether its last frame was sent: the body iterator is resumed after its last
    ``yield`` only once the server has sent that frame."""

    def __init__(self, body: AsyncIterator[bytes], turn: "TurnStream", headers: dict[str, str]):
        self.turn = turn
        self.delivered = False
        self._inner = body
        super().__init__(self._track(body), media_type="text/event-stream", headers=headers)

    async def _track(self, body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        async for chunk in body:
            yield chunk
        self.delivered = True

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.delivered:
                self.turn.abandon()
                for gen in (self.body_iterator, self._inner):  # finalize now, not when collected
                    aclose = getattr(gen, "aclose", None)
                    if aclose is not None:
                        try:
                            await aclose()
                        except BaseException:  # noqa: BLE001 - closing a finished or cancelled stream
                            pass


def to_api_error(exc: BaseException) -> APIError:
    """Map a failure of the session layer / engines to an OpenAI-shaped error."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineError):
        return from_engine_error(exc)
    log.error("turn failed", exc_info=exc)
    return internal_error(exc)


class ClientGone(APIError):
    """The client disconnected before the turn's answer could be sent (answered with a 499
    nobody reads; counted in the request metrics)."""

    def __init__(self) -> None:
        super().__init__(499, "the client closed the request before the answer was sent", code="client_closed_request")


async def disconnected(request) -> None:
    """Returns once the client has disconnected (the body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def watch_client(request, task: asyncio.Task):
    """``await task`` while watching the client: if it disconnects first, cancel the task and
    raise ``ClientGone``. Without a request (unit tests), just await the task. Served by Splice's
    own protocol (proxy/http_server.py) the server reports the disconnect; elsewhere a second
    task waits on ``receive()`` for it."""
    if request is None:
        return await task
    hook = _disconnect_hook(request)
    if hook is not None:
        return await _watch_with(hook, task)
    watcher = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        if not watcher.done():
            watcher.cancel()
    if watcher.done() and not watcher.cancelled() and watcher.exception() is None:
        if not task.done():
            task.cancel()
        raise ClientGone()
    return task.result()


class _CancelOnGone:
    """The server's disconnect callback for one task: cancels it, and remembers that it did."""

    __slots__ = ("task", "gone", "remove")

    def __init__(self, hook, task: asyncio.Task):
        self.task, self.gone = task, False
        self.remove = hook.add(self._fire)

    def _fire(self) -> None:
        self.gone = True
        self.task.cancel()


async def _watch_with(hook, task: asyncio.Task):
    """``watch_client`` with the server's disconnect callback: a client gone while the turn ran,
    even in the pass it finished, is ``ClientGone`` (the caller abandons what it committed)."""
    watch = _CancelOnGone(hook, task)
    try:
        result = await task
    except asyncio.CancelledError:
        if not watch.gone or asyncio.current_task().cancelling():  # this request itself is being cancelled
            task.cancel()
            raise
        raise ClientGone() from None
    except Exception:
        if watch.gone:
            raise ClientGone() from None
        raise
    finally:
        watch.remove()
    if watch.gone:
        raise ClientGone()
    return result


def _abandon_if_committed(runner, task: asyncio.Task) -> None:
    """Once ``task`` is over: a turn it committed was never delivered; mark it abandoned."""

    def done(t: asyncio.Task) -> None:
        if t.cancelled() or t.exception() is not None:
            return  # nothing was committed
        abandon = getattr(runner, "abandon", None)
        if abandon is not None:
            abandon(t.result())

    task.add_done_callback(done)


async def run_turn(runner, req: TurnRequest, request=None) -> TurnResult:
    """Run a turn without streaming; every failure becomes an ``APIError``. With ``request``, a
    client that disconnects cancels the turn (``ClientGone``; see the module docstring).

    Served by Splice's own protocol, the turn runs in the request's own task, which the
    server's disconnect callback cancels; elsewhere in a task of its own, watched by another."""
    hook = _disconnect_hook(request)
    if hook is not None:
        return await _run_here(runner, req, hook)
    task = asyncio.ensure_future(runner.run(req))
    try:
        return await watch_client(request, task)
    except ClientGone:
        _abandon_if_committed(runner, task)
        raise
    except asyncio.CancelledError:
        task.cancel()
        _abandon_if_committed(runner, task)
        raise
    except Exception as exc:  # noqa: BLE001
        raise to_api_error(exc) from exc


def _disconnect_hook(request):
    return None if request is None else request.scope.get("extensions", {}).get(DISCONNECT)


async def _run_here(runner, req: TurnRequest, hook) -> TurnResult:
    me = asyncio.current_task()
    watch = _CancelOnGone(hook, me)
    try:
        result = await runner.run(req)
    except asyncio.CancelledError:
        if watch.gone and me.uncancel() == 0:  # our own cancel, nobody else's (a shutdown's stays)
            raise ClientGone() from None
        raise
    except Exception as exc:  # noqa: BLE001
        if watch.gone:
            raise ClientGone() from None
        raise to_api_error(exc) from exc
    finally:
        watch.remove()
    if watch.gone:  # the client left in the pass the turn finished: committed, never delivered
        me.uncancel()
        abandon = getattr(runner, "abandon", None)
        if abandon is not None:
            abandon(result)
        raise ClientGone()
    return result


async def relay(body: AsyncIterator[bytes], stream: "TurnStream", failed: Callable[[APIError], bytes], what: str) -> AsyncIterator[bytes]:
    """The streaming skeleton every dialect shares: relay a dialect's frames; once the stream
    has started, a failure ends it in-band with the dialect's failure frame (``failed``), and a
    client that goes away stops the turn (the engine request is aborted)."""
    try:
        async for frame in body:
            yield frame
    except asyncio.CancelledError:
        stream.cancel()
        raise
    except Exception as exc:  # noqa: BLE001 - after the stream started, errors go in-band
        err = to_api_error(exc)
        log.warning("streamed %s failed: %s", what, err.message)
        yield failed(err)
    finally:
        stream.cancel()


_END = object()


class TurnStream:
    """A turn running in the background; iterate it for batches of new output ids."""

    def __init__(self, runner, req: TurnRequest):
        self.req = req
        self.runner = runner
        self._vocab = getattr(runner, "vocab_size", None)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._first: list[int] | object | None = None
        self._abandoned = False
        self.task: asyncio.Task = asyncio.create_task(runner.run(req, on_tokens=self._on_tokens))
        self.task.add_done_callback(lambda _t: self._queue.put_nowait(_END))

    async def _on_tokens(self, ids: list[int], _logprobs: list[float]) -> None:
        if ids:
            check_token_ids(ids, self._vocab)  # before any decoder sees them: a 502, not a crash
            self._queue.put_nowait(list(ids))

    async def start(self, request=None) -> None:
        """Wait for the first ids or the end of the turn; raise ``APIError`` if it failed first.
        With ``request``, a client that disconnects meanwhile cancels the turn (``ClientGone``)."""
        first = asyncio.ensure_future(self._queue.get())
        try:
            self._first = await watch_client(request, first)
        except ClientGone:
            self.abandon()
            raise
        except asyncio.CancelledError:
            first.cancel()
            self.abandon()
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
            out["X-Splice-Session-Id"] = header_value(self.req.session_resolved)
        return out

    def cancel(self) -> None:
        if not self.task.done():
            self.task.cancel()

    def abandon(self) -> None:
        """The client went away before the final event was sent: stop the turn, and if it was
        committed anyway, mark it abandoned (once)."""
        if self._abandoned:
            return
        self._abandoned = True
        self.cancel()
        _abandon_if_committed(self.runner, self.task)
