"""Which recorded turn a request continues, and whether its prompt is spliced or rendered.

Pure: everything it needs from storage comes through ``TurnLookup`` (a few point lookups),
and rendering / bridging is token arithmetic in ``tokenization``. For turn K of a session,
``prompt[K] = prompt[K-1] + output[K-1] + bridge[K]`` when the request's history is the
recorded history plus new messages; otherwise the turn is rendered in full and recorded as a
fork with a reason:

- ``unknown_parent``: the history names no recorded turn;
- ``history_edited``: it names one (a Splice id, or its own session) but does not replay it;
- ``tools_changed`` / ``template_kwargs_changed``: the history matches but the tools or the
  chat-template arguments the turn was rendered with differ;
- whatever the bridge refused for (``thinking_stripped``, ...).

With the ``keep`` history-edits policy (``splice serve --history-edits keep`` or the request's
``X-Splice-History-Edits: keep``), a history that differs from a recorded turn's only in system /
developer text, in earlier tool-call arguments or in the tool definitions offered (descriptions,
parameter schemas, tools added or removed; reasoning never counts) continues that turn's
recorded tokens instead: the engine sees what was recorded, and the plan names the edits
(``history_edits``: ``system_text``, ``tool_arguments``, ``tools``) so they are recorded with the
turn and counted. Any other difference still forks. Committed turns of such requests are also
found by edit-tolerant fingerprints.

Compaction (proxy.session.roles): the summarisation request of a compaction continues the
history it summarises whatever it did to the tool list (and, under ``keep``, the system text);
a history restarted from a summary is a new segment whose parent is the summary turn, and the
summary's text in its prompt is replaced by the ids the model sampled for it.

A header-less request is matched by fingerprints of its history. Several recorded turns can
match (the sessions of a GRPO group that sampled the same answer): a turn nobody continues yet
is preferred (each continuation claims a distinct parent), then the most recent; only when
every match is already continued does the request branch one of them (a real rollback). A
Splice-issued id in the history (``resp_``/``msg_``/``call_``...) names its turn outright.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

from tokenization import ChatFormat, Message, id_chain
from tokenization.bridge import as_list
from tokenization.conversation import HistoryHash, HistoryHashes
from tokenization.vision import ImageError

from ..ids import time_ordered_hex
from ..store.images import ImageRef
from .first_renders import FirstRenders
from .images import place
from .roles import compaction_kind
from .turn import TurnRequest


class Candidate(Protocol):
    turn_id: str
    session_id: str
    continued: bool  # a later turn already continues it
    variant: bytes | None  # the tools and kwargs it was asked with (``TurnRequest.fingerprint_variant``); None: before schema 6


class TurnLookup(Protocol):
    """What the planner reads from storage."""

    def candidates(self, fingerprint: bytes, variant: bytes | None = None) -> Sequence[Candidate]:
        """Recorded turns whose answer a history with this fingerprint ends with, most recent
        first; given a ``variant``, the rows with that variant first, then those with its tools."""

    def turn_ids(self, turn_id: str) -> tuple[Sequence[int], Sequence[int]] | None:
        """(prompt ids, output ids) of a recorded turn (int32 arrays from the store)."""

    def session_of(self, turn_id: str) -> str | None: ...

    def session_exists(self, session_id: str) -> bool: ...

    def turn_images(self, turn_id: str) -> tuple[ImageRef, ...]:
        """Where the images of a recorded turn's prompt sit (empty for a text-only turn)."""

    def claimed(self, turn_id: str) -> bool:
        """Whether a turn in flight right now already continues ``turn_id``."""

    def latest_summary(self, session_id: str) -> str | None:
        """The session's latest compaction summary turn (None: none)."""


@dataclass
class Plan:
    """How a turn's prompt was built."""

    session_id: str
    prompt_ids: np.ndarray  # int32; a spliced prompt is the parent's ids plus the bridge, never re-listed
    parent_turn_id: str | None
    spliced: bool
    fork_reason: str | None
    new_session: bool = False  # the session id was minted for this turn
    ambiguous: bool = False  # several recorded turns matched the history
    history_hash: HistoryHash | None = None  # hash of the request's first ``hashed`` messages
    hashed: int = 0
    bridge_s: float = 0.0
    render_s: float = 0.0
    history_edits: tuple[str, ...] = ()  # edits continued under the ``keep`` policy (system_text, tool_arguments)
    images: tuple[ImageRef, ...] = ()  # every image in ``prompt_ids``, in order
    request_images: dict = field(default_factory=dict)  # hash -> the request's decoded image (runner)
    summary_ids: str | None = None  # a compaction restart: "carried" (the summary's sampled ids) or "retokenized"
    render_reused: bool = False  # a first turn's ids taken from an equal first turn (``FirstRenders``)


def fingerprint_keys(hashed: HistoryHash, req: TurnRequest) -> tuple[str, str, str]:
    """Fingerprints of a history: exact (tools + template kwargs), without kwargs, messages only.
    Stores before schema 6 hold a row per key; a turn is now stored under the last one only, with
    its variant (``TurnRequest.fingerprint_variant``) beside it."""
    msgs = hashed.hexdigest()
    tools = req.tools_key
    kwargs = req.kwargs_key
    return f"x:{tools}:{kwargs}:{msgs}", f"t:{tools}:{msgs}", _history_key(msgs)


def _history_key(hexdigest: str) -> str:
    """The messages-only key: what a turn is stored under since schema 6."""
    return f"m:{hexdigest}"


def digest(key: str, session_id: str | None = None) -> bytes:
    """The stored form of a fingerprint key: 12 bytes, optionally scoped to a session."""
    scoped = f"{session_id}|{key}" if session_id else key
    return hashlib.blake2b(scoped.encode(), digest_size=12).digest()


def edit_keys(hashed: HistoryHash, req: TurnRequest) -> list[tuple[tuple[str, ...], str]]:
    """Edit-tolerant fingerprints (``keep`` policy): first with the same tools, then with any
    tools (the edit ``tools``); template kwargs must still match."""
    tools = req.tools_key
    kwargs = req.kwargs_key
    forms = hashed.edit_hexdigests()
    if not forms:
        return []
    same = [(names, f"e:{'+'.join(names)}:{tools}:{kwargs}:{h}") for names, h in forms]
    anytools = [((*names, "tools"), f"e:{'+'.join(names)}:*:{kwargs}:{h}") for names, h in [((), hashed.hexdigest()), *forms]]
    return same + anytools


def answer_fingerprints(
    hashed: HistoryHash, req: TurnRequest, answer: Message, session_id: str
) -> list[tuple[bytes, bytes | None]]:
    """What a committed turn is found by, as (fingerprint, variant) rows: the history it was asked
    with plus its answer, unscoped and scoped to its session (and, for a request under the
    ``keep`` policy, its edit-tolerant forms, which carry their tools and kwargs in the key)."""
    full = hashed.copy().extend([answer])
    m = _history_key(full.hexdigest())
    v = req.fingerprint_variant
    edits = [k for _, k in edit_keys(full, req)]
    return [(digest(m), v), (digest(m, session_id), v), *((digest(k), None) for k in edits),
            *((digest(k, session_id), None) for k in edits)]  # fmt: skip


def keeps_edits(req: TurnRequest) -> bool:
    return req.history_edits_policy == "keep" or req.compaction == "summary"


def new_session_id() -> str:
    """``sess_`` and 24 time-ordered hex digits: the sessions table's key index grows at its end."""
    return "sess_" + time_ordered_hex()


class RenderError(Exception):
    """The chat template rejected the conversation."""


class PlanOffLoop(Exception):
    """Raised by ``plan(..., inline_chars=n)`` before it would tokenize more than ``n`` characters
    (a full render, or long new messages): the caller plans again in a worker thread. Nothing was
    changed yet but caches that the second call reuses."""


def message_chars(messages: list[Message]) -> tuple[int, int]:
    """(all characters of the messages, characters every render keeps: non-assistant content)."""
    total = kept = 0
    for m in messages:
        n = len(m.content)
        total += n
        if m.role != "assistant":
            kept += n
            continue
        if m.reasoning:
            total += len(m.reasoning)
        for tc in m.tool_calls:
            total += len(tc.arguments)
    return total, kept


def plan(req: TurnRequest, lookup: TurnLookup, fmt: ChatFormat, hashes: HistoryHashes | None = None, *,
         inline_chars: int | None = None, renders: FirstRenders | None = None) -> Plan:
    """Splice onto the recorded turn the request continues, or render in full (see module doc).
    ``hashes``: long histories hashed before, so a resent one is not hashed again.
    ``renders``: recent first turns' ids, reused by a first turn equal to one of them.
    ``inline_chars``: raise :class:`PlanOffLoop` instead of rendering the request in full, or of
    bridging new messages of more characters than this."""
    last_asst = last_assistant(req.messages)
    req.compaction = "restart" if req.compacted_from and last_asst < 0 else compaction_kind(req.messages, last_asst)
    history = req.messages[: last_asst + 1]
    edits = keeps_edits(req)
    hh = hashes.hash(history, edits=edits) if hashes is not None else HistoryHash(edits=edits).extend(history)
    p = _plan(req, lookup, fmt, last_asst, hh, inline_chars, renders)
    p.history_hash, p.hashed = hh, last_asst + 1
    if not isinstance(p.prompt_ids, np.ndarray):  # a full render (its cost dwarfs this pass)
        p.prompt_ids = np.asarray(p.prompt_ids, dtype=np.int32)
    return p


def last_assistant(messages: Sequence[Message]) -> int:
    """The index of the last assistant message, -1 if none: found from the end, as a tool loop
    ends in a few messages after it however long its history."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].role == "assistant":
            return i
    return -1


def _choose(cands: Sequence[Candidate], lookup: TurnLookup, hint: str | None) -> tuple[Candidate | None, bool]:
    """The turn a Splice id in the request names; else one nobody continues yet; else the most recent."""
    if not cands:
        return None, False
    named = next((c for c in cands if c.turn_id == hint), None) if hint else None
    if named is not None:
        return named, False
    free = next((c for c in cands if not c.continued and not lookup.claimed(c.turn_id)), None)
    return (free or cands[0]), len(cands) > 1


def _find(hashed: HistoryHash, req: TurnRequest, lookup: TurnLookup) -> tuple[Candidate | None, str | None, bool]:
    """The matching turn, the fork reason its match implies, and whether the match was ambiguous.

    One lookup by the history's digest; each row's ``variant`` says how it matches. A row stored
    before schema 6 has none: the per-key rows stored with it (exact, same tools) say instead."""
    exact_key, tools_key, history_key = fingerprint_keys(hashed, req)
    want = req.fingerprint_variant
    rows = lookup.candidates(digest(history_key, req.session_id), want)
    exact_old: set[str] = set()
    tools_old: set[str] = set()
    if any(r.variant is None for r in rows):
        exact_old = {c.turn_id for c in lookup.candidates(digest(exact_key, req.session_id))}
        tools_old = {c.turn_id for c in lookup.candidates(digest(tools_key, req.session_id))}
    exact = [r for r in rows if (r.turn_id in exact_old if r.variant is None else r.variant == want)]
    same_tools = [r for r in rows if (r.turn_id in tools_old if r.variant is None else r.variant[:8] == want[:8])]
    for cands, reason in ((exact, None), (same_tools, "template_kwargs_changed"), (rows, "tools_changed")):
        found, ambiguous = _choose(cands, lookup, req.parent_hint)
        if found is not None:
            return found, reason, ambiguous
    return None, None, False


def _plan(req: TurnRequest, lookup: TurnLookup, fmt: ChatFormat, last_asst: int, hh: HistoryHash,
          inline_chars: int | None = None, renders: FirstRenders | None = None) -> Plan:
    msgs = req.messages
    explicit = req.session_id

    spec = getattr(fmt, "vision", None)

    def fork(session_id: str | None, parent: str | None, reason: str | None, *, first: bool = False, **kw) -> Plan:
        kept = renders if first else None  # a first turn: a group's sessions open alike
        chars = (req.message_chars or message_chars(msgs))[0] if kept is not None else 0
        ids = kept.get(msgs, req.tools, req.chat_template_kwargs, chars) if kept is not None else None
        reused, render_s = ids is not None, 0.0
        if ids is None:
            if inline_chars is not None:
                raise PlanOffLoop()
            t0 = time.perf_counter()
            ids = _render(fmt, req)
            render_s = time.perf_counter() - t0
            if kept is not None:
                ids = kept.put(msgs, req.tools, req.chat_template_kwargs, chars, ids)
        images = _place(ids, msgs, spec) if spec is not None else ()
        return Plan(session_id or new_session_id(), ids, parent, False, reason, new_session=session_id is None,
                    render_s=render_s, images=images, render_reused=reused, **kw)  # fmt: skip

    if last_asst < 0 and req.compaction == "restart":
        return _restart(req, lookup, fmt, fork)
    if last_asst < 0:  # a first turn (or a fresh attempt in an explicit session)
        return fork(explicit, None, None, first=True)
    found, reason, ambiguous = _find(hh, req, lookup)
    edits: tuple[str, ...] = ()
    if found is None and hh.edits:
        for names, key in edit_keys(hh, req):
            found, ambiguous = _choose(lookup.candidates(digest(key, req.session_id)), lookup, req.parent_hint)
            if found is not None:
                reason, edits = None, names
                break
    if found is None:  # recorded by a release that hashed histories with BLAKE2b (HistoryHash)?
        if inline_chars is not None:  # a second pass over the whole history, and most likely a render
            raise PlanOffLoop()
        legacy = HistoryHash(legacy=True).extend(msgs[: last_asst + 1])
        found, reason, ambiguous = _find(legacy, req, lookup)
    if reason == "tools_changed" and keeps_edits(req):  # the tool list is not what keep / a compaction forks on
        reason, edits = None, ("tools",)
    if found is None:
        hinted = lookup.session_of(req.parent_hint) if req.parent_hint else None
        if hinted is not None:
            return fork(explicit or hinted, req.parent_hint, "history_edited")
        if explicit and lookup.session_exists(explicit):
            return fork(explicit, None, "history_edited")
        return fork(explicit, None, "unknown_parent")
    session_id = explicit or found.session_id
    if reason is not None:
        return fork(session_id, found.turn_id, reason, ambiguous=ambiguous)
    ids = lookup.turn_ids(found.turn_id)
    if ids is None:  # gone between the lookups (cannot happen while turns are never deleted)
        return fork(session_id, None, "unknown_parent")
    prev_prompt, prev_output = ids
    if inline_chars is not None and message_chars(msgs[last_asst + 1 :])[0] > inline_chars:
        raise PlanOffLoop()
    t0 = time.perf_counter()
    res = fmt.bridge(
        prev_prompt, prev_output, list(msgs[last_asst + 1 :]), tools=req.tools, history=list(msgs[: last_asst + 1]),
        template_kwargs=req.chat_template_kwargs,
    )
    bridge_s = time.perf_counter() - t0
    if not res.ok:
        return fork(session_id, found.turn_id, res.reason, ambiguous=ambiguous, bridge_s=bridge_s)
    images: tuple[ImageRef, ...] = ()
    if spec is not None:  # the parent's images stay where they are; the new messages' follow
        base = len(prev_prompt) + len(prev_output)
        images = lookup.turn_images(found.turn_id) + _place(res.ids, msgs[last_asst + 1 :], spec, base=base)
    prompt = id_chain.join(prev_prompt, prev_output, res.ids)  # appended after the parent's ids, not copied
    return Plan(session_id, prompt, found.turn_id, True, None, ambiguous=ambiguous,
                bridge_s=bridge_s, history_edits=edits, images=images)  # fmt: skip


def _restart(req: TurnRequest, lookup: TurnLookup, fmt: ChatFormat, fork) -> Plan:
    """A history restarted from a compaction summary: rendered in full, its parent the summary
    turn, the summary's text in the prompt replaced by the ids the model sampled for it."""
    summary = req.compacted_from
    session = req.session_id or (lookup.session_of(summary) if summary else None)
    if summary is None and session is not None and lookup.session_exists(session):
        summary = lookup.latest_summary(session)
    p = fork(session, summary, None)
    if summary is not None and (ids := lookup.turn_ids(summary)) is not None:
        ids = (as_list(ids[0]), as_list(ids[1]))
        carried = False
        if not p.images:  # image offsets were placed on the rendered ids; leave those prompts as rendered
            p.prompt_ids, carried = carry_summary(fmt, p.prompt_ids, *ids)
        p.summary_ids = "carried" if carried else "retokenized"
    return p


def summary_content_ids(fmt: ChatFormat, prompt: list[int], output: list[int]) -> tuple[str, list[int]] | None:
    """The summary turn's answer text and the output ids that spell it (reasoning and the stop
    token left out), or None when no output span decodes to the answer."""
    parsed = fmt.parse(output, prompt_ids=prompt, tools=[], finish_reason="stop")
    text = (parsed.content or "").strip()
    if not text:
        return None
    tok = fmt.tokenizer
    stops = set(fmt.stop_token_ids)
    end = len(output)
    while end and output[end - 1] in stops:
        end -= 1
    def tail(start: int) -> str:
        return tok.decode(output[start:end], skip_special_tokens=False).strip()

    # The answer is a suffix of the output (after any reasoning); decoded suffixes only get
    # shorter as the start moves right, so a binary search finds the longest start that still
    # holds all of it (O(log n) decodes).
    lo, hi = 0, end
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(tail(mid)) >= len(text):
            lo = mid
        else:
            hi = mid - 1
    if tail(lo) != text:
        return None
    return text, list(output[lo:end])


def _rfind(seq: list[int], sub: list[int], start: int = 0) -> int:
    """The last index >= ``start`` where ``sub`` occurs in ``seq`` (-1: nowhere)."""
    n = len(sub)
    for i in range(len(seq) - n, start - 1, -1):
        if seq[i] == sub[0] and seq[i : i + n] == sub:
            return i
    return -1


def carry_summary(fmt: ChatFormat, prompt: list[int], summary_prompt: list[int], summary_output: list[int]) -> tuple[list[int], bool]:
    """``prompt`` with the re-tokenized summary replaced by its sampled ids (unchanged, False,
    when the summary's text is not found verbatim in the prompt).

    The summary's first and last tokens may merge with the text around it when re-tokenized in
    the restarted prompt (``.`` + ``\n`` is one token), so the summary is found by its inner
    tokens, and the few characters around it in the tokens replaced are re-encoded on their
    own: the prompt's text is unchanged, only the summary's ids are the sampled ones."""
    found = summary_content_ids(fmt, summary_prompt, summary_output)
    if found is None:
        return prompt, False
    text, sampled = found
    tok = fmt.tokenizer
    enc = tok.encode(text, add_special_tokens=False)
    n = len(enc)
    if n < 3:
        at = _rfind(prompt, enc) if n else -1
        return (prompt[:at] + sampled + prompt[at + n :], True) if at >= 0 else (prompt, False)
    k = min(8, n - 2)
    head = _rfind(prompt, enc[1 : 1 + k])
    tail = _rfind(prompt, enc[n - 1 - k : n - 1], head) if head >= 0 else -1
    if tail < 0:
        return prompt, False
    s, e = max(0, head - 1), min(len(prompt), tail + k + 1)
    piece = tok.decode(prompt[s:e], skip_special_tokens=False)
    at = piece.find(text)
    if at < 0:
        return prompt, False
    before, after = piece[:at], piece[at + len(text) :]
    new = tok.encode(before, add_special_tokens=False) + sampled + tok.encode(after, add_special_tokens=False)
    if tok.decode(new, skip_special_tokens=False) != piece:
        return prompt, False
    return prompt[:s] + new + prompt[e:], True


def _place(ids, messages, spec, *, base: int = 0) -> tuple[ImageRef, ...]:
    try:
        return place(ids, messages, spec, base=base)
    except ImageError as exc:
        raise RenderError(str(exc)) from exc


def _render(fmt: ChatFormat, req: TurnRequest) -> list[int]:
    try:
        return fmt.render(req.messages, req.tools, template_kwargs=req.chat_template_kwargs)
    except Exception as exc:  # noqa: BLE001 - any template failure is the conversation's fault
        raise RenderError(str(exc)) from exc
