"""R2 (docs/design.md section 4): give held tokens of version ``V-1`` their proximal logprob under ``V``.

After the weights move to version ``V``, every stored token sampled by ``V-1`` that has no
proximal value yet is owed ``log pi_V(x_i | x_<i)``, so the trainer's segment-wise importance
weight uses the right policy. The values come **per session leaf** (``leaves``): one prefill of
the longest stored path holding owed turns, from the first owed position, written back to every
owed turn on that path. When they are computed:

- an **open** session is not recomputed eagerly: its next turn's own engine call asks for the
  input logprobs from the first owed position and fills them (``RecomputeScheduler.piggyback``);
- **closed** (rewarded) sessions, which send no further turn, are recomputed in the background
  soon after an update (``soon``) and before a pull hands them out;
- whatever is still owed is prefilled before the next pause (the weights that give ``pi_V`` go
  away at the next update), waiting at most ``deadline_s``; what is not done by then stays
  ``proximal == behaviour`` with ``proximal_versions == versions`` (missing, as for a proxy
  that was down), is counted in ``splice_proximal_missing_tokens`` and logged, and the pause
  proceeds.

A failed engine call leaves its tokens as they were and they are retried at the next deadline.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from engines.types import Generation

from ..metrics import Metrics
from ..store import Store, TurnRecord
from .images import engine_images
from .leaves import Path, place, plan_leaves, plan_prompt

log = logging.getLogger(__name__)


class PrefillPool(Protocol):
    async def prefill_logprobs(self, *, input_ids: list[int], start: int, session_id: str, images=()) -> list[float]:
        """One logprob per token ``input_ids[start:]``: ``log pi(input_ids[i] | input_ids[:i])``;
        ``images``: every image whose placeholders ``input_ids`` hold (engines.types.EngineImage)."""
        ...


@dataclass
class RecomputeReport:
    sessions: int = 0  # sessions that owed values
    turns: int = 0  # owed turns covered by the prefills
    prefills: int = 0  # engine prefill calls made (one per leaf)
    prefill_tokens: int = 0  # tokens those calls sent
    tokens: int = 0  # tokens that got a proximal value
    failures: int = 0  # leaves left as they were (engine error or a malformed answer)
    stale_tokens: int = 0  # owed tokens not recomputed: their sample is older than --max-staleness
    timed_out: bool = False  # the deadline passed before everything owed was done
    missing_tokens: int = 0  # owed tokens left without a value when a pause went ahead
    wait_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def apply_prefill(turn: TurnRecord, values: list[float | None], version: int) -> tuple[list[float], list[int], int]:
    """New proximal arrays for ``turn`` given ``values[i]`` = log pi_version of output token ``i``.

    Only tokens sampled by ``version - 1`` that still lack a proximal value change; ``None``
    or non-finite values are skipped. Returns (proximal_logprobs_t, proximal_versions, changed).
    """
    if len(values) != len(turn.output_ids):
        raise ValueError(f"prefill returned {len(values)} logprobs for {len(turn.output_ids)} output tokens")
    prox = list(turn.proximal_logprobs_t)
    prox_versions = list(turn.proximal_versions)
    changed = 0
    for i, (v, pv) in enumerate(zip(turn.versions, turn.proximal_versions)):
        value = values[i]
        if v == version - 1 and pv == v and value is not None and math.isfinite(value):
            prox[i] = float(value)
            prox_versions[i] = version
            changed += 1
    return prox, prox_versions, changed


async def recompute_owed_report(
    store: Store,
    pool: PrefillPool,
    version: int,
    *,
    session_id_for: Callable[[Path], str] = lambda p: p.session_id,
    concurrency: int = 2,
    closed_only: bool = False,
    min_version: int | None = None,
    report: RecomputeReport | None = None,
) -> RecomputeReport:
    """Settle what is owed under ``version``: one prefill per session leaf, committed per leaf.

    ``concurrency`` workers take owed sessions one at a time, loading each only when its turn
    comes, so memory stays bounded however much is owed. ``report`` (when given) is filled in
    as work completes, so a caller that gives up at a deadline still sees what was done.
    """
    report = report or RecomputeReport()
    owed = await asyncio.to_thread(store.turns.owed_sessions, version, closed_only=closed_only)
    report.sessions += len(owed)
    queue = iter(owed)

    async def leaf(path: Path) -> None:
        report.prefills += 1
        report.prefill_tokens += int(path.input_ids.size)
        kw = {}
        refs = await asyncio.to_thread(store.images.refs_of, path.leaf_turn_id) if path.leaf_turn_id else ()
        if refs:  # the engine needs every image of the prefilled ids (their spans lie in the leaf's prompt)
            kw["images"] = await asyncio.to_thread(engine_images, refs, {}, store.images.get)
        values = await pool.prefill_logprobs(
            input_ids=path.input_ids.tolist(), start=path.start, session_id=session_id_for(path), **kw
        )
        want = int(path.input_ids.size) - path.start
        if len(values) != want:
            raise ValueError(f"prefill returned {len(values)} logprobs for {want} positions")
        # Written in one transaction that re-reads the turns: a value another path (or the
        # session's next turn) filled meanwhile is kept, never overwritten.
        report.tokens += store.turns.fill_proximal(place(path, list(values), path.start), version)

    async def session(session_id: str) -> None:
        turns = await asyncio.to_thread(store.turns.tokens_of, session_id)
        paths, stale = plan_leaves(session_id, turns, version, min_version=min_version)
        report.stale_tokens += stale
        for path in paths:
            report.turns += len(path.turns)
            try:
                await leaf(path)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # an engine error must not stop the others; the tokens stay owed
                report.failures += 1
                log.warning("recompute of session %s (leaf %s) under v%d failed: %s", session_id, path.leaf_turn_id, version, exc)

    async def worker() -> None:
        for session_id in queue:  # one shared iterator: each session goes to exactly one worker
            try:
                await session(session_id)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                report.failures += 1
                log.warning("recompute of session %s under v%d failed: %s", session_id, version, exc)

    await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
    if report.failures:
        log.warning(
            "recompute under v%d: %d leaves failed, %d tokens updated from %d prefills",
            version, report.failures, report.tokens, report.prefills,
        )  # fmt: skip
    return report


async def recompute_owed(
    store: Store,
    pool: PrefillPool,
    version: int,
    *,
    session_id_for: Callable[[Path], str] = lambda p: p.session_id,
    concurrency: int = 2,
) -> int:
    """R2 for ``version``; returns the number of tokens that got a proximal value."""
    report = await recompute_owed_report(store, pool, version, session_id_for=session_id_for, concurrency=concurrency)
    return report.tokens


@dataclass
class Piggyback:
    """The owed values a session's next turn will compute: its engine call asks for the input
    logprobs of its prompt from ``path.start`` (under ``version``)."""

    path: Path
    version: int
    elsewhere: int  # owed tokens of the session on other branches (a deadline settles them)


class RecomputeScheduler:
    """When R2 runs (module docstring): piggybacked on next turns, in the background for closed
    sessions, and at deadlines (pause, pull) with a bounded wait."""

    def __init__(
        self,
        store: Store,
        pool,
        metrics: Metrics,
        *,
        deadline_s: float = 60.0,
        max_staleness: int | None = None,
        concurrency: int | None = None,
    ):
        self.store = store
        self.pool = pool
        self.metrics = metrics
        self.deadline_s = float(deadline_s)
        self.max_staleness = max_staleness
        replicas = len(getattr(pool, "urls", ()) or ()) or 1
        self.concurrency = concurrency or getattr(pool, "prefill_concurrency", 2) * replicas
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        self._owed_version: int | None = None
        self._owed: set[str] = set()
        self._fills: set[asyncio.Task] = set()
        self._refreshing: asyncio.Task | None = None

    # -- which sessions owe values (kept in memory: the turn path asks in O(1)) ----------------

    @property
    def min_version(self) -> int | None:
        """Tokens older than this are past ``--max-staleness`` (None: no limit)."""
        return None if self.max_staleness is None else self.pool.version - self.max_staleness

    def _index(self) -> set[str]:
        v = self.pool.version
        if self._owed_version != v:
            # The version moved without an admin call (the pool followed its engines): read the
            # index in the background; until then no turn piggybacks (the deadline covers them).
            if self._refreshing is None or self._refreshing.done():
                self._refreshing = asyncio.get_running_loop().create_task(self.refresh())
            return set()
        return self._owed

    async def refresh(self) -> None:
        """Re-read which sessions owe values (after a version change), off the event loop."""
        v = self.pool.version
        owed = await asyncio.to_thread(self.store.turns.owed_sessions, v)
        if self.pool.version == v:
            self._owed, self._owed_version = set(owed), v

    def owes(self, session_id: str) -> bool:
        return session_id in self._index()

    def note_turn(self, session_id: str, gen: Generation) -> None:
        """A committed turn that holds tokens owed under the current version (it finished
        under ``V-1`` after the index was read): its session owes values."""
        v = self.pool.version
        if self._owed_version != v or not gen.versions:
            return
        if gen.aborts:  # several versions: look at every token
            owes = any(x == v - 1 and p == x for x, p in zip(gen.versions, gen.proximal_versions))
        else:  # one engine call, one version: the first token says it
            owes = gen.versions[0] == v - 1 and gen.proximal_versions[0] == v - 1
        if owes:
            self._owed.add(session_id)

    # -- piggyback: the next turn's own engine call ---------------------------------------------

    async def piggyback(self, session_id: str, prompt_ids: list[int]) -> Piggyback | None:
        """What the session's next turn (``prompt_ids``) should ask its engine call for, or None.

        Only called for a session that owes values (``owes``), so a turn of a session that owes
        nothing reads nothing; a session that owes reads its token paths once per update, in a
        worker thread (the event loop keeps serving other turns)."""
        if self.pool.paused:
            return None  # the call waits for the resume, under other weights
        version = self.pool.version
        mv = self.min_version

        def plan() -> tuple[Path | None, int, bool]:
            turns = self.store.turns.tokens_of(session_id)
            path, elsewhere = plan_prompt(session_id, turns, version, prompt_ids)
            stale = mv is not None and any(t.versions.size and int(t.versions.min()) < mv for t in turns if not t.abandoned)
            return path, elsewhere, stale

        path, elsewhere, stale = await asyncio.to_thread(plan)
        if self._owed_version == version:
            # Planned once per update: what this prompt does not hold (another branch) is left
            # to the deadline, so later turns of the session never read its paths again.
            self._owed.discard(session_id)
        if path is None:
            return None
        if stale:
            return None  # its sample will be dropped at pull: never paid for
        return Piggyback(path, version, elsewhere)

    def fill_from(self, pig: Piggyback, gen: Generation) -> None:
        """Write the values the turn's call returned, in a worker thread after the turn answers
        (``flush`` and every deadline wait for it first)."""
        if gen.prompt_logprobs_version != pig.version or not gen.prompt_logprobs:
            return  # the weights moved first, or the engine gave none: a deadline settles them
        values = place(pig.path, gen.prompt_logprobs, gen.prompt_logprobs_start)
        task = asyncio.get_running_loop().create_task(self._fill(pig, values))
        self._fills.add(task)
        task.add_done_callback(self._fills.discard)

    async def _fill(self, pig: Piggyback, values: dict[str, list[float | None]]) -> int:
        try:
            changed = await asyncio.to_thread(self.store.turns.fill_proximal, values, pig.version)
        except Exception:
            log.exception("session %s: could not store the proximal values of its next turn", pig.path.session_id)
            if self._owed_version == pig.version:
                self._owed.add(pig.path.session_id)  # a deadline settles them
            return 0
        if changed:
            self.metrics.recomputed.inc(changed)
            self.metrics.piggybacked.inc(changed)
        return changed

    async def flush(self) -> None:
        """Wait until values taken from next turns are stored."""
        while self._fills:
            await asyncio.gather(*list(self._fills), return_exceptions=True)

    # -- deadlines --------------------------------------------------------------------------------

    async def settle(self, *, closed_only: bool = False, deadline_s: float | None = None) -> RecomputeReport:
        """Prefill what is owed now (``closed_only``: rewarded sessions only), per leaf, waiting
        at most ``deadline_s`` (default: the configured deadline)."""
        report = RecomputeReport()
        await self.flush()  # values next turns already brought are not prefilled again
        if self.pool.paused:
            return report
        deadline = self.deadline_s if deadline_s is None else float(deadline_s)
        version = self.pool.version
        t0 = time.monotonic()
        async def work() -> None:
            async with self._lock:
                await recompute_owed_report(
                    self.store, self.pool, version, concurrency=self.concurrency, closed_only=closed_only,
                    min_version=self.min_version, report=report,
                )  # fmt: skip

        try:
            await asyncio.wait_for(work(), timeout=max(deadline, 0.0))
        except asyncio.TimeoutError:
            report.timed_out = True
            log.warning(
                "recompute under v%d passed its %.1f s deadline: %d tokens filled from %d prefills, the rest stays owed",
                version, deadline, report.tokens, report.prefills,
            )  # fmt: skip
        report.wait_s = time.monotonic() - t0
        m = self.metrics
        if report.tokens:
            m.recomputed.inc(report.tokens)
        m.recompute_prefills.inc(report.prefills)
        m.recompute_prefill_tokens.inc(report.prefill_tokens)
        if report.stale_tokens:
            m.stale_skipped.inc(report.stale_tokens)
        if not report.timed_out and not report.failures and self._owed_version == version and not closed_only:
            self._owed.clear()  # everything owed under this version was settled (or is stale)
        return report

    async def before_pause(self, *, recompute: bool = True) -> RecomputeReport:
        """The pause deadline: settle what is owed (at most ``deadline_s``), then count what is
        left as missing; the pause always proceeds."""
        await self.cancel_background()
        if self.pool.paused:
            return RecomputeReport()  # paused already: the previous pause counted what was left
        report = await self.settle() if recompute else RecomputeReport()
        version = self.pool.version
        left = await asyncio.to_thread(self.store.turns.owed_tokens, version)
        left = max(left - report.stale_tokens, 0)
        if left:
            report.missing_tokens = left
            self.metrics.missing.inc(left)
            log.warning(
                "pause at v%d: %d tokens of v%d have no proximal value (%s); they keep proximal == behaviour",
                version, left, version - 1, "deadline passed" if report.timed_out else "not recomputed",
            )  # fmt: skip
        self.metrics.pause_wait_seconds.observe(report.wait_s)
        return report

    async def run(self) -> int:
        """Recompute everything owed now (deadline applies); returns the tokens that got a value."""
        return (await self.settle()).tokens

    # -- background (closed sessions, after an update) --------------------------------------------

    def soon(self) -> None:
        """Recompute closed sessions in the background (failures are logged; the values stay owed)."""
        task = asyncio.get_running_loop().create_task(self._safe_run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _safe_run(self) -> None:
        try:
            await self.settle(closed_only=True)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("recompute after weight update failed; values stay owed")

    async def cancel_background(self) -> None:
        """Stop background work (a pause's own settle takes over what is left)."""
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def drain(self) -> None:
        await self.flush()
        # The index read runs in a worker thread: the store is closed only after it ends.
        pending = [*self._tasks, *([self._refreshing] if self._refreshing else [])]
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
