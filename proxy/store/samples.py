"""Turn a rewarded session's turns into training samples (docs/design.md section 5, longest active prefix).

Samples are assembled when the trainer pulls, from the stored turns, so proximal logprobs
recomputed after the turn finished are always the ones handed out. Pure functions, no I/O.

Arrays are NumPy (int32 ids and versions, float32 logprobs, uint8 mask), built by vectorised
fills, never per-token Python lists: a 100k-token sample costs ~21 bytes per token while it is
assembled. The shape handed out is versioned (``SAMPLE_SCHEMA_VERSION``,
``proxy/schemas/sample.schema.json``, docs/samples.md).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import numpy as np

from .packing import F32, I32
from .records import SessionRecord, TurnRecord

log = logging.getLogger(__name__)

SAMPLE_SCHEMA_VERSION = 3  # bump on any change of the sample's shape (docs/samples.md)

U8 = np.dtype("u1")
# name -> dtype of every per-token array, in wire order
TOKEN_ARRAYS: dict[str, np.dtype] = {
    "input_ids": I32,
    "loss_mask": U8,
    "logprobs": F32,
    "versions": I32,
    "proximal_logprobs_t": F32,
    "proximal_versions": I32,
}


@dataclass
class TurnSpan:
    """Where one turn sits in its sample, and how it was sampled.

    Tokens ``[context_start, start)`` are what the turn added before its output (its new prompt
    tail: tool results, user messages, template tokens; mask 0); ``[start, start + length)`` are
    the tokens it sampled (mask 1).
    """

    turn_id: str
    index: int
    context_start: int
    start: int
    length: int
    finish_reason: str
    fork_reason: str | None
    spliced: bool
    created_at: float
    model: str | None  # the model the proxy served the turn with
    engine_id: str | None  # the engine replica that sampled it (its base URL)
    temperature: float | None  # what the engine sampled with (None: not recorded)
    top_p: float | None
    top_k: int | None  # -1: off
    role: str = "main"  # main | auxiliary | subagent | compacted (proxy.session.roles)


@dataclass
class TurnTokens:
    """A stored turn as NumPy arrays (output coordinates), for assembly without Python lists."""

    turn_id: str
    index: int
    prompt_ids: np.ndarray
    output_ids: np.ndarray
    output_logprobs: np.ndarray
    versions: np.ndarray
    proximal_logprobs_t: np.ndarray
    proximal_versions: np.ndarray
    spliced: bool
    fork_reason: str | None
    finish_reason: str
    created_at: float
    requested_sampling: dict
    images: tuple = ()  # ImageRef of every image in the prompt (proxy.store.images)
    abandoned: bool = False
    role: str = "main"

    @classmethod
    def of(cls, turn: "TurnRecord | TurnTokens") -> "TurnTokens":
        if isinstance(turn, TurnTokens):
            return turn
        return cls(
            turn_id=turn.turn_id, index=turn.index,
            prompt_ids=np.asarray(turn.prompt_ids, dtype=np.int64).astype(I32),
            output_ids=np.asarray(turn.output_ids, dtype=np.int64).astype(I32),
            output_logprobs=np.asarray(turn.output_logprobs, dtype=F32),
            versions=np.asarray(turn.versions, dtype=np.int64).astype(I32),
            proximal_logprobs_t=np.asarray(turn.proximal_logprobs_t, dtype=F32),
            proximal_versions=np.asarray(turn.proximal_versions, dtype=np.int64).astype(I32),
            spliced=turn.spliced, fork_reason=turn.fork_reason, finish_reason=turn.finish_reason,
            created_at=turn.created_at, requested_sampling=turn.requested_sampling or {}, abandoned=turn.abandoned,
            images=tuple(turn.images), role=getattr(turn, "role", "main"),
        )  # fmt: skip

    def check(self) -> None:
        """Raise ``ValueError`` if the per-token arrays disagree in length or hold non-finite logprobs."""
        n = self.output_ids.size
        sizes = {
            "output_logprobs": self.output_logprobs.size,
            "versions": self.versions.size,
            "proximal_logprobs_t": self.proximal_logprobs_t.size,
            "proximal_versions": self.proximal_versions.size,
        }
        bad = {k: v for k, v in sizes.items() if v != n}
        if bad:
            raise ValueError(f"turn {self.turn_id}: per-token arrays must have {n} entries (output_ids), got {bad}")
        if self.index < 0:
            raise ValueError(f"turn {self.turn_id}: index must be >= 0, got {self.index}")
        for name in ("output_logprobs", "proximal_logprobs_t"):
            if not np.all(np.isfinite(getattr(self, name))):
                raise ValueError(f"turn {self.turn_id}: {name} holds a non-finite value")

    def span(self, context_start: int, start: int) -> TurnSpan:
        rs = self.requested_sampling or {}
        used = rs.get("used") or {}
        return TurnSpan(
            turn_id=self.turn_id, index=self.index, context_start=context_start, start=start,
            length=int(self.output_ids.size), finish_reason=self.finish_reason, fork_reason=self.fork_reason,
            spliced=bool(self.spliced), created_at=float(self.created_at), model=rs.get("model"),
            engine_id=rs.get("engine_id"), temperature=used.get("temperature"), top_p=used.get("top_p"),
            top_k=used.get("top_k"), role=self.role,
        )  # fmt: skip


@dataclass
class Sample:
    """One training sequence; every array has ``len(input_ids)`` entries (token coordinates)."""

    sample_id: str
    session_id: str
    group_id: str | None
    reward: float | None
    rewarded_at: float | None = None
    input_ids: np.ndarray = field(default_factory=lambda: np.empty(0, I32))
    loss_mask: np.ndarray = field(default_factory=lambda: np.empty(0, U8))
    logprobs: np.ndarray = field(default_factory=lambda: np.empty(0, F32))
    versions: np.ndarray = field(default_factory=lambda: np.empty(0, I32))
    proximal_logprobs_t: np.ndarray = field(default_factory=lambda: np.empty(0, F32))
    proximal_versions: np.ndarray = field(default_factory=lambda: np.empty(0, I32))
    turns: list[TurnSpan] = field(default_factory=list)
    # False when a turn was sampled with the agent's own settings (``--sampling honor``): its
    # behaviour logprobs come from another distribution than the trainer's.
    trainable: bool = True
    # Every image in ``input_ids`` (ImageRef: hash, offset of its first placeholder, count, grid);
    # its bytes come from ``GET /v1/images/{hash}``.
    images: list = field(default_factory=list)
    # The episode segment it is (proxy.session.roles): the agent's conversation (``main``), one
    # it runs inside the episode (``subagent``), its continuation after a compaction
    # (``compacted``), or a harness side call (``auxiliary``, handed out only with --train-auxiliary).
    role: str = "main"

    def __len__(self) -> int:
        return int(self.input_ids.size)

    @property
    def turn_ids(self) -> list[str]:
        return [t.turn_id for t in self.turns]

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in TOKEN_ARRAYS}

    def header(self) -> dict:
        """Every field but the per-token arrays."""
        return {
            "schema_version": SAMPLE_SCHEMA_VERSION,
            "sample_id": self.sample_id,
            "session_id": self.session_id,
            "group_id": self.group_id,
            "role": self.role,
            "reward": self.reward,
            "rewarded_at": self.rewarded_at,
            "trainable": self.trainable,
            "n_tokens": len(self),
            "turn_ids": self.turn_ids,
            "turns": [asdict(t) for t in self.turns],
            "images": [r.to_dict() for r in self.images],
        }

    def to_json(self) -> dict:
        """The JSON wire shape, for orjson with ``OPT_SERIALIZE_NUMPY``: float32 logprobs widened
        to float64 so the text is the one ``GET /v1/sessions/{id}`` writes for the same value."""
        d = self.header()
        for name in TOKEN_ARRAYS:
            a = getattr(self, name)
            d[name] = a.astype(np.float64) if a.dtype == F32 else a
        return d

    def to_dict(self) -> dict:
        """The sample with plain Python lists (tests, small tools)."""
        d = self.header()
        d.update({name: getattr(self, name).tolist() for name in TOKEN_ARRAYS})
        return d


def _longest(matches: list["_Plan"]) -> "_Plan":
    return max(matches, key=len)  # equal lengths are identical token lists: the oldest wins


_choose = _longest  # the rule, named so a test can prove the first-match rule would fail


@dataclass
class _Part:
    """What a sample keeps of one turn once planned: its span and output arrays, not its prompt."""

    span: TurnSpan
    logprobs: np.ndarray
    versions: np.ndarray
    proximal_logprobs_t: np.ndarray
    proximal_versions: np.ndarray
    trainable: bool


@dataclass
class _Plan:
    """A sample being planned: its current tokens (the last turn's prompt + output) and turns."""

    sample: Sample
    ids: np.ndarray
    parts: list[_Part] = field(default_factory=list)
    images: tuple = ()

    def __len__(self) -> int:
        return int(self.ids.size)


def assemble_samples(session: SessionRecord, turns: "Iterable[TurnRecord | TurnTokens]", *,
                     train_auxiliary: bool = False) -> list[Sample]:
    """Merge turns into prefix-stable samples.

    Turns are taken in index order: a list is sorted here; any other iterable must already
    come in index order (``TurnTable.iter_tokens``), and is consumed one turn at a time so
    only the samples' own tokens stay in memory, not every turn's prompt.
    A turn whose prompt starts with an existing sample's full token list extends that sample
    (new prompt tokens masked out, output tokens trained on); when several samples match, the
    longest wins, because a shorter match is a stale prefix of a later rollback branch (seed
    002) and extending it would file sampled tokens as prompt. Otherwise the turn starts a new
    sample; earlier samples are never modified by a fork.

    A turn only extends a sample of its own role (an episode's main conversation, a sub-agent's,
    the continuation after a compaction), and every sample carries the role. Auxiliary turns
    (harness side calls) are left out unless ``train_auxiliary``: then they are samples of
    their own.
    """
    ordered = sorted(turns, key=lambda t: t.index) if isinstance(turns, (list, tuple)) else turns
    plans: list[_Plan] = []
    for turn in map(TurnTokens.of, ordered):
        if turn.abandoned:  # never delivered to its client: not a trajectory anyone acted on
            continue
        if turn.role == "auxiliary" and not train_auxiliary:
            continue
        turn.check()
        prompt = turn.prompt_ids
        matches = [p for p in plans if p.sample.role == turn.role and len(p) <= prompt.size and np.array_equal(prompt[: len(p)], p.ids)]
        if len(matches) > 1:
            log.warning(
                "ambiguous prefix match in session %s turn %d (%s): %d of %d samples match "
                "(lens=%s, prompt_len=%d); extending the longest",
                session.session_id,
                turn.index,
                turn.turn_id,
                len(matches),
                len(plans),
                sorted(len(p) for p in matches),
                prompt.size,
            )
        if matches:
            plan = _choose(matches)
        else:
            sample = Sample(
                sample_id=f"{session.session_id}:{len(plans)}",
                session_id=session.session_id,
                group_id=session.group_id,
                reward=session.reward,
                rewarded_at=session.rewarded_at,
                role=turn.role,
            )
            plan = _Plan(sample, np.empty(0, I32))
            plans.append(plan)
        plan.parts.append(
            _Part(turn.span(len(plan), prompt.size), turn.output_logprobs, turn.versions, turn.proximal_logprobs_t,
                  turn.proximal_versions, (turn.requested_sampling or {}).get("trainable") is not False)
        )  # fmt: skip
        plan.ids = np.concatenate([prompt, turn.output_ids])
        plan.images = turn.images  # the prompt's images; an output holds none
    return [_fill(p) for p in plans]


def _fill(plan: _Plan) -> Sample:
    """The arrays of a planned sample: context tokens 0 / -1, each turn's output in place."""
    s, n = plan.sample, len(plan)
    s.input_ids = plan.ids
    s.images = list(plan.images)
    s.loss_mask = np.zeros(n, U8)
    s.logprobs = np.zeros(n, F32)
    s.versions = np.full(n, -1, I32)
    s.proximal_logprobs_t = np.zeros(n, F32)
    s.proximal_versions = np.full(n, -1, I32)
    for part in plan.parts:
        start, end = part.span.start, part.span.start + part.span.length
        s.loss_mask[start:end] = 1
        s.logprobs[start:end] = part.logprobs
        s.versions[start:end] = part.versions
        s.proximal_logprobs_t[start:end] = part.proximal_logprobs_t
        s.proximal_versions[start:end] = part.proximal_versions
        s.turns.append(part.span)
        s.trainable &= part.trainable
    return s
