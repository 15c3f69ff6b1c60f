"""Runs one agent turn end to end: plan (splice or fork), sample, generate under the session's
lock, parse, let the front end present it, commit, count."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import threading
import time
import weakref

from engines.http import check_token_ids, redact_url, vocab_bound
from engines.types import EngineError, Generation
from tokenization import ChatFormat, Message
from tokenization.conversation import HistoryHashes, ToolCall

from ..errors import APIError, from_engine_error
from ..ids import call_id, chat_completion_id, message_id, response_id
from ..metrics import Metrics
from ..store import Conflict, Store, StoredResponse, TurnRecord
from ..turn_log import TurnWatch
from .drift import DriftChecker
from .episodes import EpisodeRoles
from .first_renders import FirstRenders
from .images import as_stored, engine_images, request_images
from .planner import Plan, PlanOffLoop, RenderError, answer_fingerprints, message_chars, plan
from .recompute import Piggyback, RecomputeScheduler
from .sampling import SamplingPolicy
from .turn import TokensCallback, TurnRequest, TurnResult

log = logging.getLogger("splice.session")
_redacted = functools.lru_cache(maxsize=256)(redact_url)  # a replica's url, once: not per turn

_RESPONSE_IDS = {"responses": response_id, "chat": chat_completion_id, "messages": message_id}

# A plan that tokenizes more characters than this (a full render of a long conversation, or long
# new messages) runs in a worker thread, so one huge request never stalls the event loop. A splice
# onto a long recorded history tokenizes only the new messages: it stays inline, as thread
# hand-offs cost a long-history turn about as much as its plan.
PLAN_INLINE_CHARS = 32_768


def max_token_chars(tokenizer) -> int:
    """The most characters one token can stand for (byte-level BPE: bytes >= characters)."""
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max((len(p) for p in pieces if p), default=1)


_token_chars: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> Future[int]
_token_chars_lock = threading.Lock()


def max_token_chars_soon(tokenizer) -> concurrent.futures.Future:
    """:func:`max_token_chars` computed in a daemon thread from now on, once per tokenizer: a
    pass over the whole vocabulary (~0.1 s) paid at start-up, not by the first long turn."""
    with _token_chars_lock:
        try:
            fut = _token_chars.get(tokenizer)
            if fut is not None:
                return fut
            fut = _token_chars[tokenizer] = concurrent.futures.Future()
        except TypeError:  # not weakly referable or not hashable: no sharing
            fut = concurrent.futures.Future()

    def work() -> None:
        try:
            fut.set_result(max_token_chars(tokenizer))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever awaits it
            fut.set_exception(exc)

    threading.Thread(target=work, name="splice-max-token-chars", daemon=True).start()
    return fut


class StoreLookup:
    """The planner's view of the store, plus the parents claimed by turns in flight."""

    def __init__(self, store: Store):
        self.store = store
        self.inflight_parents: dict[str, int] = {}

    def candidates(self, fingerprint: bytes, variant: bytes | None = None):
        return self.store.turns.candidates(fingerprint, variant)

    def turn_ids(self, turn_id: str):
        return self.store.turns.ids(turn_id)

    def session_of(self, turn_id: str):
        return self.store.turns.session_of(turn_id)

    def session_exists(self, session_id: str) -> bool:
        return self.store.sessions.get(session_id) is not None

    def turn_images(self, turn_id: str):
        return self.store.images.refs_of(turn_id)

    def claimed(self, turn_id: str) -> bool:
        return turn_id in self.inflight_parents

    def latest_summary(self, session_id: str):
        return self.store.turns.latest_summary(session_id)

    def claim(self, turn_id: str | None) -> None:
        if turn_id is not None:
            self.inflight_parents[turn_id] = self.inflight_parents.get(turn_id, 0) + 1

    def release(self, turn_id: str | None) -> None:
        if turn_id is not None:
            left = self.inflight_parents.pop(turn_id, 1) - 1
            if left > 0:
                self.inflight_parents[turn_id] = left


def returned_message(result: TurnResult) -> Message:
    """The assistant message as the client will replay it (call ids derived from the turn)."""
    p = result.parsed
    calls = tuple(ToolCall(call_id(result.turn_id, k), c.name, c.arguments) for k, c in enumerate(p.tool_calls))
    return Message("assistant", p.content, reasoning=p.reasoning, tool_calls=calls)


class TurnRunner:
    """One per proxy process."""

    def __init__(self, fmt: ChatFormat, pool, store: Store, metrics: Metrics, *, sampling: SamplingPolicy,
                 drift: DriftChecker, model_name: str, recompute: RecomputeScheduler | None = None,
                 history_edits: str = "fork"):  # fmt: skip
        self.fmt = fmt
        self.history_edits = history_edits  # the server's policy; a request's X-Splice-History-Edits overrides it
        self.pool = pool
        self.store = store
        self.metrics = metrics
        self.sampling = sampling
        self.drift = drift
        self.model_name = model_name
        self.recompute = recompute  # R2: a session owing values gets them from its next turn's call
        self.lookup = StoreLookup(store)
        self.hashes = HistoryHashes()  # long histories' hashes, continued when a request resends one
        self.first_renders = FirstRenders()  # first turns' ids, for the next session that opens alike
        self.roles = EpisodeRoles(store)  # main / auxiliary / subagent / compacted (proxy.session.roles)
        self._locks: dict[str, asyncio.Lock] = {}
        self._background: set[asyncio.Task] = set()
        self._open = 0  # turns between their start and their end: one alone commits without waiting for company
        self._ambiguous_logged: set[str] = set()
        self.vocab_size = vocab_bound(fmt.tokenizer)
        self._max_token_chars = max_token_chars_soon(fmt.tokenizer)  # a future: read when a long request comes
        spec = getattr(fmt, "vision", None)
        # A vision model never samples its placeholder / vision-control tokens (docs/images.md).
        self.banned_ids: tuple[int, ...] = tuple(sorted(spec.banned_ids)) if spec is not None else ()

    def _lock(self, session_id: str) -> asyncio.Lock:
        lock = self._locks.get(session_id)
        if lock is None:
            if len(self._locks) > 65536:
                self._locks = {k: v for k, v in self._locks.items() if v.locked()}
            lock = self._locks[session_id] = asyncio.Lock()
        return lock

    def _plan(self, req: TurnRequest, inline_chars: int | None = None) -> Plan:
        if req.history_edits_policy is None:
            req.history_edits_policy = self.history_edits
        try:
            p = plan(req, self.lookup, self.fmt, self.hashes, inline_chars=inline_chars, renders=self.first_renders)
        except RenderError as exc:
            raise APIError(400, f"the chat template cannot render this conversation: {exc}", code="invalid_messages") from None
        m = self.metrics.stage_seconds
        if p.bridge_s:
            m.labels("bridge").observe(p.bridge_s)
        if p.render_s:
            m.labels("render").observe(p.render_s)
        if p.render_reused:
            self.metrics.render_reused.inc()
        if p.ambiguous:
            self.metrics.ambiguous_parents.inc()
            if p.session_id not in self._ambiguous_logged and len(self._ambiguous_logged) < 65536:
                self._ambiguous_logged.add(p.session_id)
                log.info("session %s: several recorded turns matched the history; chose %s", p.session_id, p.parent_turn_id)
        return p

    async def run(self, req: TurnRequest, on_tokens: TokensCallback | None = None) -> TurnResult:
        self._open += 1
        try:
            return await self._run(req, on_tokens)
        finally:
            self._open -= 1
            # A request runs once. Its dialect context holds it and it holds the context's
            # ``present``: dropping that link lets reference counting free the whole request
            # (messages, parsed body) at once, instead of leaving a cycle per turn for the
            # collector, whose full passes then cost tens of milliseconds each.
            req.present = None

    async def _run(self, req: TurnRequest, on_tokens: TokensCallback | None) -> TurnResult:
        t_start = time.perf_counter()
        chars, kept = req.message_chars or message_chars(req.messages)
        if chars > PLAN_INLINE_CHARS:
            await self._check_fits(req, kept)
            try:
                p = self._plan(req, inline_chars=PLAN_INLINE_CHARS)
            except PlanOffLoop:
                p = await asyncio.to_thread(self._plan, req)
        else:
            p = self._plan(req)
        req.session_resolved = p.session_id
        if p.images:
            p.request_images = request_images(req.messages)
        req.history_edits = p.history_edits
        self.roles.assign(req, p, p.new_session)
        session = None if p.new_session else self.store.sessions.for_turn(p.session_id)  # kept between turns
        if session is not None and session.closed:
            raise APIError(409, f"session {p.session_id} already has a reward and is closed", code="session_closed")
        params = self.sampling.params(req, len(p.prompt_ids), tuple(self.fmt.stop_token_ids))
        if self.banned_ids:
            params = dataclasses.replace(params, banned_token_ids=self.banned_ids)
        if self.sampling.overridden(req):
            self.metrics.sampling_overrides.inc()
        self.lookup.claim(p.parent_turn_id)
        watch = TurnWatch.start(p, req.turn_id, on_tokens)  # the console's progress and per-turn lines
        try:
            async with self._lock(p.session_id):
                pig = await self._piggyback(p)
                self.metrics.inflight.inc()
                try:
                    gen = await self._generate(p, params, watch.on_tokens, pig)
                finally:
                    self.metrics.inflight.dec()
                result = self._result(req, p, gen)
                t_commit = time.perf_counter()
                await self._commit(req, p, result, session)
                self.metrics.stage_seconds.labels("commit").observe(time.perf_counter() - t_commit)
                self._settle_owed(p, gen, pig)
        finally:
            self.lookup.release(p.parent_turn_id)
            watch.stop()
        self._count(req, p, gen, result)
        watch.finished(result, time.perf_counter() - t_start, p, req)
        self.metrics.proxy_seconds.observe(max(0.0, time.perf_counter() - t_start - gen.engine_time_s))
        if p.spliced:
            try:
                work = self.drift.note(req, result, p.parent_turn_id, recorded=result.drift_recorded)
            except Exception:  # noqa: BLE001 - the turn is committed: a drift count never fails it
                log.exception("turn %s: drift check failed", result.turn_id)
                work = None
            if work is not None:  # most spliced turns decide at once: no task
                self._spawn(work)
        return result

    async def _check_fits(self, req: TurnRequest, chars: int) -> None:
        """``context_length_exceeded`` before any tokenizing when the text cannot fit: every
        token stands for at most ``max_token_chars`` characters of it."""
        soon = self._max_token_chars
        per_token = soon.result() if soon.done() else await asyncio.wrap_future(soon)
        limit = self.sampling.max_context * per_token
        if chars > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {self.sampling.max_context} tokens; the messages hold "
                f"{chars} characters, more than {limit} ({per_token} per token at most) can fit.",
                code="context_length_exceeded",
                param="input" if req.api == "responses" else "messages",
            )

    def abandon(self, result: TurnResult) -> None:
        """The client went away before the turn's final body or event was sent: the committed
        turn is marked abandoned, and sample assembly never uses it (docs/design.md section 11)."""
        try:
            self.store.turns.abandon(result.turn_id)
        except Exception:  # noqa: BLE001 - best effort; logged
            log.exception("could not mark turn %s abandoned", result.turn_id)
        self.metrics.abandoned.inc()
        log.info("turn %s of session %s abandoned: the client went away before it was delivered", result.turn_id, result.session_id)

    async def _piggyback(self, p: Plan) -> Piggyback | None:
        """R2 on the next turn: when the session owes proximal values that this prompt contains,
        the turn's own engine call computes them (the update flushed the engine's prefix cache,
        so the prompt is re-read anyway). O(1) for a session that owes nothing."""
        if self.recompute is None or p.new_session or not self.recompute.owes(p.session_id):
            return None
        t0 = time.perf_counter()
        try:
            return await self.recompute.piggyback(p.session_id, p.prompt_ids)
        except Exception:  # noqa: BLE001 - never fail a turn over R2: a deadline settles the values
            log.exception("session %s: could not plan its owed proximal values", p.session_id)
            return None
        finally:
            self.metrics.stage_seconds.labels("r2_plan").observe(time.perf_counter() - t0)

    def _settle_owed(self, p: Plan, gen: Generation, pig: Piggyback | None) -> None:
        if self.recompute is None:
            return
        try:
            if pig is not None:
                self.recompute.fill_from(pig, gen)  # stored in the background, off this turn
            self.recompute.note_turn(p.session_id, gen)
        except Exception:  # noqa: BLE001 - the turn is committed; the values stay owed
            log.exception("session %s: could not store the proximal values of its next turn", p.session_id)

    async def _generate(self, p: Plan, params, on_tokens: TokensCallback | None, pig: Piggyback | None = None) -> Generation:
        kw = {} if pig is None else {"prompt_logprobs_from": pig.path.start}
        if p.images:
            try:
                kw["images"] = engine_images(p.images, p.request_images, self.store.images.get)
            except LookupError as exc:
                raise APIError(409, f"{exc}; the session cannot be continued", code="image_not_stored") from None
        try:
            gen = await self.pool.generate(p.prompt_ids, params, session_id=p.session_id, on_tokens=on_tokens, **kw)
            check_token_ids(gen.output_ids, self.vocab_size, gen.replica)
            return gen
        except EngineError as exc:
            raise from_engine_error(exc) from exc

    def _result(self, req: TurnRequest, p: Plan, gen: Generation) -> TurnResult:
        t0 = time.perf_counter()
        stop_text = gen.matched_stop if isinstance(gen.matched_stop, str) else None
        parsed = self.fmt.parse(
            gen.output_ids, prompt_ids=p.prompt_ids, tools=req.tools, finish_reason=gen.finish_reason, stop_text=stop_text
        )
        self.metrics.stage_seconds.labels("parse").observe(time.perf_counter() - t0)
        return TurnResult(
            turn_id=req.turn_id,
            session_id=p.session_id,
            response_id=_RESPONSE_IDS[req.api](req.turn_id),
            prompt_ids=p.prompt_ids,
            generation=gen,
            parsed=parsed,
            spliced=p.spliced,
            fork_reason=p.fork_reason,
            created_at=time.time(),
            model=req.model or self.model_name,
            role=req.role or "main",
        )

    async def _commit(self, req: TurnRequest, p: Plan, result: TurnResult, known) -> None:
        """One savepoint: the session (when new or changed), the turn, its fingerprints and,
        for the Responses API, its stored response, in the transaction of every turn that
        finished in the same pass of the event loop (proxy/store/group_commit.py). On the loop,
        not in a thread: a WAL commit without fsync takes well under a millisecond, and a writer
        thread would pay GIL hand-offs on every SQLite call under load."""
        gen = result.generation
        stored = None
        if req.present is not None:
            presented = req.present(result)
            result.body, result.encoded = presented.body, presented.encoded
            if presented.conversation is not None:
                stored = StoredResponse(result.response_id, presented.encoded, presented.conversation)
        unchanged = (
            known is not None
            and req.group_id in (None, known.group_id)
            and req.group_size in (None, known.group_size)
            and not req.metadata
        )
        fields = None if unchanged else {"group_id": req.group_id, "group_size": req.group_size, "metadata": req.metadata or None}
        turn = TurnRecord(
            turn_id=result.turn_id,
            session_id=p.session_id,
            index=-1,  # the session's next index, assigned in the commit
            parent_turn_id=p.parent_turn_id,
            prompt_ids=p.prompt_ids,
            output_ids=list(gen.output_ids),
            output_logprobs=list(gen.logprobs),
            versions=list(gen.versions),
            proximal_logprobs_t=list(gen.proximal_logprobs_t),
            proximal_versions=list(gen.proximal_versions),
            spliced=p.spliced,
            fork_reason=p.fork_reason,
            finish_reason=gen.finish_reason,
            created_at=result.created_at,
            requested_sampling=self._record_sampling(req, gen) | self.roles.record(req, p),
            drift=p.spliced and self.drift.inherited(p.parent_turn_id),
            api=req.api,
            response_id=result.response_id,
            images=p.images,
            role=req.role or "main",
        )
        new_images = [as_stored(p.request_images[r.hash]) for r in p.images
                      if r.hash in p.request_images and not self.store.images.is_known(r.hash)]  # fmt: skip
        hashed = p.history_hash.copy().extend(req.messages[p.hashed :])
        fingerprints = answer_fingerprints(hashed, req, returned_message(result), p.session_id)
        try:
            await self.store.turns.add_grouped(
                turn, fingerprints=fingerprints, response=stored, session_fields=fields, new_images=new_images,
                on_lost=lambda: self.abandon(result), alone=self._open == 1,
            )  # fmt: skip
        except Conflict as exc:  # rewarded while this turn was generating, or a different group
            now = self.store.sessions.get(p.session_id)
            code = "session_closed" if now is not None and now.closed else "session_conflict"
            raise APIError(409, str(exc), code=code) from exc
        result.index = turn.index
        result.drift_recorded = turn.drift
        if new_images:
            self.store.images.remember(new_images)

    def _record_sampling(self, req: TurnRequest, gen: Generation) -> dict:
        rec = {**self.sampling.record(req), "model": self.model_name, "engine_id": _redacted(gen.replica) or None}
        if self.banned_ids and not set(self.banned_ids).isdisjoint(gen.output_ids):
            # The engine sampled a token it was told never to: not the distribution the trainer
            # scores, so the turn (and its sample) is not trained on.
            rec["trainable"] = False
            rec["untrainable_reason"] = "sampled_banned_token"
            self.metrics.banned_tokens_sampled.inc()
        return rec

    def _count(self, req: TurnRequest, p: Plan, gen: Generation, result: TurnResult) -> None:
        m = self.metrics
        m.turns.labels(req.api).inc()
        m.roles.labels(req.role or "main").inc()
        m.tokens_in.inc(len(p.prompt_ids))
        m.tokens_out.inc(len(gen.output_ids))
        if p.images:
            m.images_in.inc(len(p.images))
        m.engine_seconds.observe(gen.engine_time_s)
        if p.spliced:
            m.spliced.inc()
        elif p.fork_reason:
            m.forks.labels(p.fork_reason).inc()
        for edit in p.history_edits:
            m.history_edits.labels(edit).inc()
        if gen.aborts:
            m.aborts.inc(gen.aborts)
            m.resumes.inc(max(0, gen.segments - 1))
        if result.parsed.malformed:
            m.malformed_calls.inc(len(result.parsed.malformed_calls))
        for typ in req.tools_not_offered:
            m.tools_not_offered.labels(typ).inc()
        for control in req.controls_not_enforced:
            m.controls_not_enforced.labels(control).inc()

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain(self) -> None:
        if self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)
