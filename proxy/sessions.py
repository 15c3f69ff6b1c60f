"""The session layer: find the turn a request continues, splice or fork, generate, commit.

For turn K of a session: ``prompt[K] = prompt[K-1] + output[K-1] + bridge[K]`` when the
request's history is the recorded history plus new messages; otherwise the turn is rendered
in full and recorded as a fork with a reason. Every finished turn is committed to the store
before the response is returned.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from engines.types import EngineError, Generation, SamplingParams
from tokenization import ChatFormat, Message
from tokenization.conversation import HistoryHash, ToolCall, tools_fingerprint

from .errors import APIError
from .ids import call_id, chat_completion_id, new_turn_id, response_id
from .metrics import Metrics
from .records import TurnRecord
from .settings import Settings
from .store import Conflict, Store
from .turn_types import TokensCallback, TurnRequest, TurnResult

log = logging.getLogger("splice.sessions")


@dataclass
class Plan:
    """How a turn's prompt was built."""

    session_id: str
    prompt_ids: list[int]
    parent_turn_id: str | None
    spliced: bool
    fork_reason: str | None
    history_hash: HistoryHash | None = None  # hash of the request's first ``hashed`` messages
    hashed: int = 0


def _keys(hashed: HistoryHash, req: TurnRequest) -> tuple[str, str, str]:
    """Fingerprints of a history: exact (tools + template kwargs), without kwargs, messages only."""
    msgs = hashed.hexdigest()
    tools = tools_fingerprint(req.tools)
    kwargs = repr(sorted((req.chat_template_kwargs or {}).items()))
    return f"x:{tools}:{kwargs}:{msgs}", f"t:{tools}:{msgs}", f"m:{msgs}"


def _digest(key: str, session_id: str | None = None) -> bytes:
    """The stored form of a fingerprint key: 12 bytes, optionally scoped to a session."""
    scoped = f"{session_id}|{key}" if session_id else key
    return hashlib.blake2b(scoped.encode(), digest_size=12).digest()


class TurnRunner:
    """Runs one agent turn end to end. One instance per proxy process."""

    def __init__(self, fmt: ChatFormat, pool, store: Store, settings: Settings, metrics: Metrics):
        self.fmt = fmt
        self.tokenizer = fmt.tokenizer
        self.renderer = fmt.renderer
        self.model_name = settings.model_name
        self.pool = pool
        self.store = store
        self.settings = settings
        self.metrics = metrics
        self._ids: OrderedDict[str, tuple[list[int], list[int]]] = OrderedDict()  # turn -> (prompt, output)
        self._ids_cap = 8192
        self._locks: dict[str, asyncio.Lock] = {}
        self._background: set[asyncio.Task] = set()
        self._drifted: OrderedDict[str, bool] = OrderedDict()  # turn -> a full re-render would differ
        self._turn_index: OrderedDict[str, int] = OrderedDict()

    # -- locating the previous turn -------------------------------------------------------

    def _turn_ids(self, turn_id: str) -> tuple[list[int], list[int]] | None:
        hit = self._ids.get(turn_id)
        if hit is not None:
            self._ids.move_to_end(turn_id)
            return hit
        turn = self.store.get_turn(turn_id)
        if turn is None:
            return None
        self._remember(turn_id, turn.prompt_ids, turn.output_ids)
        return turn.prompt_ids, turn.output_ids

    def _remember(self, turn_id: str, prompt: list[int], output: list[int]) -> None:
        self._ids[turn_id] = (prompt, output)
        if len(self._ids) > self._ids_cap:
            self._ids.popitem(last=False)

    def _find(self, keys: tuple[str, ...], session_id: str | None) -> tuple[str, str] | None:
        """``(turn_id, session_id)`` of the recorded turn for a history fingerprint, preferring the caller's session."""
        for key in keys:
            if session_id:
                hit = self.store.lookup_fingerprint(_digest(key, session_id))
                if hit is not None:
                    return hit
            hit = self.store.lookup_fingerprint(_digest(key))
            if hit is not None and (session_id is None or hit[1] == session_id):
                return hit
        return None

    def plan(self, req: TurnRequest) -> Plan:
        last_asst = max((i for i, m in enumerate(req.messages) if m.role == "assistant"), default=-1)
        hh = HistoryHash().extend(req.messages[: last_asst + 1])
        plan = self._plan(req, last_asst, hh.copy())
        plan.history_hash, plan.hashed = hh, last_asst + 1
        return plan

    def _plan(self, req: TurnRequest, last_asst: int, hh: HistoryHash) -> Plan:
        msgs = req.messages
        explicit = req.session_id
        session_id = explicit
        if last_asst < 0:
            # A first turn (or a fresh attempt in an explicit session): render in full.
            return Plan(session_id or _new_session_id(), self._render(msgs, req), None, False, None)

        history = msgs[: last_asst + 1]
        new = msgs[last_asst + 1 :]
        exact, no_kwargs, plain = _keys(hh, req)
        parent = self._find((exact,), explicit)
        reason = None
        if parent is None:
            other = self._find((no_kwargs,), explicit)
            if other is not None:
                parent, reason = other, "template_kwargs_changed"
            else:
                other = self._find((plain,), explicit)
                if other is not None:
                    parent, reason = other, "tools_changed"
        if parent is None:
            hinted = self.store.get_turn(req.parent_hint) if req.parent_hint else None
            if hinted is not None:
                session_id = session_id or hinted.session_id
                return Plan(session_id, self._render(msgs, req), hinted.turn_id, False, "history_edited")
            if explicit and self.store.get_session(explicit) is not None:
                return Plan(explicit, self._render(msgs, req), None, False, "history_edited")
            return Plan(session_id or _new_session_id(), self._render(msgs, req), None, False, "unknown_parent")

        parent_turn_id, parent_session = parent
        session_id = session_id or parent_session
        if reason is not None:
            return Plan(session_id, self._render(msgs, req), parent_turn_id, False, reason)
        ids = self._turn_ids(parent_turn_id)
        if ids is None:
            return Plan(session_id, self._render(msgs, req), None, False, "unknown_parent")
        prev_prompt, prev_output = ids
        t0 = time.perf_counter()
        res = self.fmt.bridge(prev_prompt, prev_output, list(new), tools=req.tools, history=list(history))
        self.metrics.stage_seconds.labels("bridge").observe(time.perf_counter() - t0)
        if not res.ok:
            return Plan(session_id, self._render(msgs, req), parent_turn_id, False, res.reason)
        return Plan(session_id, prev_prompt + prev_output + res.ids, parent_turn_id, True, None)

    def _render(self, msgs: list[Message], req: TurnRequest) -> list[int]:
        t0 = time.perf_counter()
        try:
            ids = self.fmt.render(msgs, req.tools)
        except Exception as exc:  # the template rejected the conversation
            raise APIError(400, f"the chat template cannot render this conversation: {exc}", code="invalid_messages")
        self.metrics.stage_seconds.labels("render").observe(time.perf_counter() - t0)
        return ids

    # -- running a turn -------------------------------------------------------------------

    def _sampling(self, req: TurnRequest, prompt_len: int) -> SamplingParams:
        room = self.settings.max_context - prompt_len
        if room <= 0:
            raise APIError(
                400,
                f"This model's maximum context length is {self.settings.max_context} tokens; the prompt has "
                f"{prompt_len} tokens.",
                code="context_length_exceeded",
                param="messages" if req.api == "chat" else "input",
            )
        want = req.max_output_tokens or self.settings.default_max_tokens
        max_new = max(1, min(want, room))  # clamped to what fits
        stop_ids = tuple(self.fmt.stop_token_ids)
        if self.settings.sampling == "honor":
            return SamplingParams(
                max_new_tokens=max_new,
                temperature=req.temperature if req.temperature is not None else 1.0,
                top_p=req.top_p if req.top_p is not None else 1.0,
                stop=tuple(req.stop),
                stop_token_ids=stop_ids,
            )
        if (req.temperature not in (None, self.settings.temperature)) or (req.top_p not in (None, 1.0)):
            self.metrics.sampling_overrides.inc()
        return SamplingParams(
            max_new_tokens=max_new, temperature=self.settings.temperature, top_p=1.0, top_k=-1,
            stop=tuple(req.stop), stop_token_ids=stop_ids,
        )

    def _lock(self, session_id: str) -> asyncio.Lock:
        lock = self._locks.get(session_id)
        if lock is None:
            if len(self._locks) > 65536:
                self._locks = {k: v for k, v in self._locks.items() if v.locked()}
            lock = self._locks[session_id] = asyncio.Lock()
        return lock

    async def run(self, req: TurnRequest, on_tokens: TokensCallback | None = None) -> TurnResult:
        t_start = time.perf_counter()
        plan = self.plan(req)
        session = self.store.get_session(plan.session_id)
        if session is not None and session.closed:
            raise APIError(409, f"session {plan.session_id} already has a reward and is closed", code="session_closed")
        params = self._sampling(req, len(plan.prompt_ids))
        async with self._lock(plan.session_id):
            self.metrics.inflight.inc()
            try:
                gen = await self._generate(plan, params, on_tokens)
            finally:
                self.metrics.inflight.dec()
            t_parse = time.perf_counter()
            stop_text = gen.matched_stop if isinstance(gen.matched_stop, str) else None
            parsed = self.fmt.parse(
                gen.output_ids, prompt_ids=plan.prompt_ids, tools=req.tools, finish_reason=gen.finish_reason,
                stop_text=stop_text,
            )
            self.metrics.stage_seconds.labels("parse").observe(time.perf_counter() - t_parse)
            turn_id = req.turn_id or new_turn_id()
            result = TurnResult(
                turn_id=turn_id,
                session_id=plan.session_id,
                response_id=response_id(turn_id) if req.api == "responses" else chat_completion_id(turn_id),
                prompt_ids=plan.prompt_ids,
                generation=gen,
                parsed=parsed,
                spliced=plan.spliced,
                fork_reason=plan.fork_reason,
                created_at=time.time(),
                model=req.model or self.model_name,
            )
            t_commit = time.perf_counter()
            try:
                # Inline, not in a thread: a WAL commit without fsync takes well under a millisecond,
                # and a writer thread would pay GIL hand-offs on every SQLite call under load.
                self._commit(req, plan, result, session)
            except Conflict as exc:  # rewarded while this turn was generating, or a different group
                now = self.store.get_session(plan.session_id)
                raise APIError(409, str(exc), code="session_closed" if now is not None and now.closed else "session_conflict") from exc
            self.metrics.stage_seconds.labels("commit").observe(time.perf_counter() - t_commit)
        self._count(req, plan, gen, parsed)
        self.metrics.proxy_seconds.observe(max(0.0, time.perf_counter() - t_start - gen.engine_time_s))
        if plan.spliced:
            self._spawn(self._check_drift(req, result, plan.parent_turn_id))
        return result

    async def _generate(self, plan: Plan, params: SamplingParams, on_tokens) -> Generation:
        async def forward(ids: list[int], _logprobs: list[float]) -> None:
            if on_tokens is not None:
                await on_tokens(ids)

        try:
            gen = await self.pool.generate(
                plan.prompt_ids, params, session_id=plan.session_id, on_tokens=forward if on_tokens else None
            )
        except EngineError as exc:
            raise APIError(exc.status_code, f"engine error: {exc}", code=exc.code, headers={"Retry-After": "1"}) from exc
        return gen

    def _commit(self, req: TurnRequest, plan: Plan, result: TurnResult, known) -> None:
        gen = result.generation
        store = self.store
        unchanged = (
            known is not None
            and req.group_id in (None, known.group_id)
            and req.group_size in (None, known.group_size)
            and not req.metadata
        )
        # A continuing turn of a known session writes nothing but the turn: one commit per turn.
        session = known if unchanged else store.upsert_session(
            plan.session_id, group_id=req.group_id, group_size=req.group_size, metadata=req.metadata or None
        )
        index = store.next_turn_index(plan.session_id)
        requested = {
            "temperature": req.temperature,
            "top_p": req.top_p,
            "stop": list(req.stop),
            "max_output_tokens": req.max_output_tokens,
            "mode": self.settings.sampling,
            "trainable": self.settings.sampling == "trainable",
        }
        turn = TurnRecord(
            turn_id=result.turn_id,
            session_id=session.session_id,
            index=index,
            parent_turn_id=plan.parent_turn_id,
            prompt_ids=plan.prompt_ids,
            output_ids=list(gen.output_ids),
            output_logprobs=list(gen.logprobs),
            versions=list(gen.versions),
            proximal_logprobs_t=list(gen.proximal_logprobs_t),
            proximal_versions=list(gen.proximal_versions),
            spliced=plan.spliced,
            fork_reason=plan.fork_reason,
            finish_reason=gen.finish_reason,
            created_at=result.created_at,
            requested_sampling=requested,
            drift=False,
            api=req.api,
            response_id=result.response_id,
        )
        # Fingerprints of the history this turn's answer extends, for the next request to find it.
        hashed = (plan.history_hash or HistoryHash()).copy()
        hashed.extend(req.messages[plan.hashed :]).extend([self._returned_message(result)])
        keys = _keys(hashed, req)
        self._turn_index[turn.turn_id] = index
        if len(self._turn_index) > self._ids_cap:
            self._turn_index.popitem(last=False)
        store.add_turn(turn, fingerprints=[*(_digest(k) for k in keys), *(_digest(k, session.session_id) for k in keys)])
        self._remember(turn.turn_id, plan.prompt_ids, turn.output_ids)

    def _returned_message(self, result: TurnResult) -> Message:
        p = result.parsed
        calls = tuple(ToolCall(call_id(result.turn_id, k), c.name, c.arguments) for k, c in enumerate(p.tool_calls))
        return Message("assistant", p.content, reasoning=p.reasoning, tool_calls=calls)

    def _count(self, req: TurnRequest, plan: Plan, gen: Generation, parsed) -> None:
        m = self.metrics
        m.turns.labels(req.api).inc()
        m.tokens_in.inc(len(plan.prompt_ids))
        m.tokens_out.inc(len(gen.output_ids))
        m.engine_seconds.observe(gen.engine_time_s)
        if plan.spliced:
            m.spliced.inc()
        elif plan.fork_reason:
            m.forks.labels(plan.fork_reason).inc()
        if gen.aborts:
            m.aborts.inc(gen.aborts)
            m.resumes.inc(max(0, gen.segments - 1))
        if parsed.malformed:
            m.malformed_calls.inc(len(parsed.malformed_calls))

    # -- background work ------------------------------------------------------------------

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _should_check_drift(self, index: int) -> bool:
        mode = self.settings.drift_check
        if mode == "all":
            return True
        if mode == "off":
            return False
        return index < 8 or (index & (index - 1)) == 0  # sampled: early turns, then powers of two

    async def _check_drift(self, req: TurnRequest, result: TurnResult, parent_turn_id: str | None) -> None:
        """Would a full re-render have tokenized this prompt differently? Off the hot path.

        A turn spliced onto a turn that drifted drifts too (the re-render repeats the earlier
        difference), so only sessions that have not drifted yet pay for a full render.
        """
        drifted = self._drifted.get(parent_turn_id) if parent_turn_id else None
        if drifted is None:
            index = self._turn_index.get(result.turn_id, 0)
            if not self._should_check_drift(index):
                return
            try:
                full = await asyncio.to_thread(
                    self.fmt.renderer.render_ids, _renderer_msgs(req.messages),
                    tools=self.fmt.renderer_tools(req.tools), add_generation_prompt=True,
                )
            except Exception:
                return
            drifted = list(full) != result.prompt_ids
        self._drifted[result.turn_id] = drifted
        if len(self._drifted) > self._ids_cap:
            self._drifted.popitem(last=False)
        if drifted:
            self.metrics.drift.inc()
            if hasattr(self.store, "set_drift"):
                await asyncio.to_thread(self.store.set_drift, result.turn_id, True)

    async def drain(self) -> None:
        if self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)



def _renderer_msgs(messages):
    from tokenization.conversation import to_renderer_messages

    return to_renderer_messages(messages)


def _new_session_id() -> str:
    return "sess_" + uuid.uuid4().hex[:24]
