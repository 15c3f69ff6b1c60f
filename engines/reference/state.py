"""What both HTTP front ends share: the worker, the pause gate, in-flight rids, errors.

The pause gate lives on the event loop: while paused, new requests wait here (they do not
fail) until generation continues, as SGLang and vLLM behave.
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

import orjson
from fastapi import Request
from fastapi.responses import Response

from .generator import Job, Snapshot, Worker
from .lm import LanguageModel


class BadRequest(Exception):
    """A request the real server would reject with HTTP 400 (or ``status``)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class EngineState:
    """One engine: model, worker, pause gate and the rids currently in flight."""

    def __init__(self, lm: LanguageModel, worker: Worker, *, served_model_name: str, script_mode: bool):
        self.lm = lm
        self.worker = worker
        self.served_model_name = served_model_name
        self.script_mode = script_mode
        self.tokenizer_path = lm.model_dir  # the tokenizer never changes with a weight update
        self.started = time.time()
        self.inflight: dict[str, Job] = {}
        self._running: asyncio.Event | None = None
        self.weight_groups = None  # weight_sync.WeightGroups, set by the app factory
        self.images = None  # vision.ImageProcessor when the model takes images
        if lm.vision is not None:
            from .vision import ImageProcessor

            self.images = ImageProcessor(lm.vision)

    @property
    def running(self) -> asyncio.Event:
        if self._running is None:  # created lazily so it binds to the server's loop
            self._running = asyncio.Event()
            self._running.set()
        return self._running

    @property
    def paused(self) -> bool:
        return not self.running.is_set()

    async def pause(self, mode: str) -> None:
        self.running.clear()
        await asyncio.wrap_future(self.worker.pause(mode))

    async def resume(self) -> None:
        await asyncio.wrap_future(self.worker.resume())
        self.running.set()

    async def admit(self, job: Job, request: Request | None = None) -> "JobWatch":
        """Wait while paused, then register the rid (400 when still in flight) and submit.

        A client that disconnects while waiting raises ClientGone and is never submitted.
        """
        if not self.running.is_set():
            await _wait_running_or_gone(self.running, request)
        if job.rid in self.inflight:
            raise BadRequest(f"Duplicate request ID {job.rid!r}: a request with this rid is still in flight.")
        watch = JobWatch(job)
        self.inflight[job.rid] = job
        self.worker.submit(job)
        return watch

    def release(self, job: Job) -> None:
        if self.inflight.get(job.rid) is job:
            del self.inflight[job.rid]

    def abort_if_running(self, job: Job) -> None:
        if not job.done.is_set():
            self.worker.abort(job.rid)


class JobWatch:
    """Turns the worker's per-token callbacks into awaitable snapshots on the event loop."""

    def __init__(self, job: Job):
        self.job = job
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
        job.on_update = self._poke

    def _poke(self) -> None:
        self._loop.call_soon_threadsafe(self._changed.set)

    async def updates(self) -> AsyncIterator[Snapshot]:
        """Yield a snapshot after each change until (and including) the finished one."""
        while True:
            await self._changed.wait()
            self._changed.clear()
            snap = self.job.snapshot()
            yield snap
            if snap.finish is not None:
                return

    async def result(self, request: Request | None = None) -> Snapshot:
        """The finished snapshot; aborts the job if the HTTP client disconnects first."""
        watcher = asyncio.create_task(wait_disconnect(request)) if request is not None else None
        try:
            while not self.job.done.is_set():
                waiter = asyncio.create_task(self._changed.wait())
                pending = {waiter} | ({watcher} if watcher is not None else set())
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                self._changed.clear()
                if watcher is not None and watcher in done:
                    waiter.cancel()
                    raise ClientGone()
                waiter.cancel()
            return self.job.snapshot()
        finally:
            if watcher is not None:
                watcher.cancel()


class ClientGone(Exception):
    """The HTTP client disconnected before its generation finished."""


async def _wait_running_or_gone(running: asyncio.Event, request: Request | None) -> None:
    if request is None:
        await running.wait()
        return
    resumed = asyncio.create_task(running.wait())
    gone = asyncio.create_task(wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({resumed, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        resumed.cancel()
        gone.cancel()
    if resumed not in done:
        raise ClientGone()


async def wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg.get("type") == "http.disconnect":
            return


def json_response(obj, status: int = 200) -> Response:
    """A JSON response serialised with orjson (fast, and NaN-free output is enforced by the caller)."""
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


def error_response(message: str, status: int = 400) -> Response:
    """SGLang's error body for /generate and friends."""
    return json_response({"error": {"message": message}}, status)


async def read_json(request: Request) -> dict:
    """The request body as a JSON object, or BadRequest."""
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"invalid JSON body: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def sse(obj) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
