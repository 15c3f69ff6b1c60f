"""One console line per finished turn, and a progress line for a turn still running.

``splice serve`` turns this on (``--quiet`` turns it off); it writes to stderr through the
``splice.turns`` logger, which does not propagate, so the root level (``SPLICE_LOG_LEVEL``,
WARNING by default) does not hide it and library users of ``create_app`` see nothing unless
they configure that logger. A finished turn's line says where it landed (spliced, or the fork
reason), its tokens (and how many of the prompt the engine reused from its prefix cache) and
where the time went (engine vs proxy); a turn still running after ``PROGRESS_AFTER_S`` gets a
line then and every ``PROGRESS_EVERY_S`` after, so a slow engine is never silent.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time

log = logging.getLogger("splice.turns")

PROGRESS_AFTER_S = 5.0
PROGRESS_EVERY_S = 30.0


def configure(enabled: bool, stream=None) -> None:
    """Print turn lines to ``stream`` (stderr) when ``enabled``; silence them otherwise."""
    for h in list(log.handlers):
        if getattr(h, "_splice_turns", False):
            log.removeHandler(h)
    log.propagate = False
    if not enabled:
        log.setLevel(logging.WARNING)
        return
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
    handler._splice_turns = True  # type: ignore[attr-defined]
    log.addHandler(handler)
    log.setLevel(logging.INFO)


def _where(spliced: bool, fork_reason: str | None) -> str:
    if spliced:
        return "spliced"
    return f"fork: {fork_reason}" if fork_reason else "new"


def _role(*objs) -> str:
    """The turn's role where the record carries one (main, auxiliary, ...)."""
    for o in objs:
        role = getattr(o, "role", None)
        if role:
            return f" [{role}]"
    return ""


class TurnWatch:
    """Started when a turn's engine call is about to begin; logs progress until stopped."""

    def __init__(self, session_id: str, turn_id: str, prompt_tokens: int, on_tokens=None):
        self.session_id = session_id
        self.turn_id = turn_id
        self.prompt_tokens = prompt_tokens
        self.t0 = time.perf_counter()
        self.out_tokens: int | None = None  # known only when the turn streams
        self._timer: asyncio.TimerHandle | None = None
        self._inner = on_tokens
        self.on_tokens = self._count if on_tokens is not None else None
        if log.isEnabledFor(logging.INFO):
            self._timer = asyncio.get_running_loop().call_later(PROGRESS_AFTER_S, self._progress)

    @classmethod
    def start(cls, plan, turn_id: str, on_tokens=None) -> "TurnWatch":
        return cls(plan.session_id, turn_id, len(plan.prompt_ids), on_tokens)

    async def _count(self, ids, logprobs) -> None:
        self.out_tokens = (self.out_tokens or 0) + len(ids)
        await self._inner(ids, logprobs)

    def _progress(self) -> None:
        so_far = "" if self.out_tokens is None else f", {self.out_tokens:,} output tokens so far"
        log.info("turn %s of session %s still running after %.0f s (%s prompt tokens%s)",
                 self.turn_id, self.session_id, time.perf_counter() - self.t0, f"{self.prompt_tokens:,}", so_far)  # fmt: skip
        self._timer = asyncio.get_running_loop().call_later(PROGRESS_EVERY_S, self._progress)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        # ``on_tokens`` is a method of this watch: dropped, no cycle keeps the turn's stream alive
        self.on_tokens = self._inner = None

    def finished(self, result, total_s: float, *context) -> None:
        """The line for a committed turn; ``context``: other objects that may carry its role."""
        self.stop()
        if not log.isEnabledFor(logging.INFO):
            return
        gen = result.generation
        cached = f" ({gen.cached_tokens:,} cached)" if getattr(gen, "cached_tokens", 0) else ""
        engine_ms = gen.engine_time_s * 1000.0
        proxy_ms = max(0.0, total_s * 1000.0 - engine_ms)
        log.info(
            "session %s turn %d%s: %s, %s prompt%s + %s output tokens, %s | engine %.0f ms, proxy %.0f ms",
            result.session_id, result.index, _role(result, *context), _where(result.spliced, result.fork_reason),
            f"{len(result.prompt_ids):,}", cached, f"{len(gen.output_ids):,}", gen.finish_reason, engine_ms, proxy_ms,
        )  # fmt: skip
