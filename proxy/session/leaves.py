"""Which prefills R2 needs: one per session leaf, not one per turn (docs/design.md section 4).

A session's later prompts contain its earlier turns verbatim, so the tokens a session owes
(sampled by ``V-1``, no proximal value yet) lie on few stored token paths. A *leaf* is the
longest stored sequence (some turn's prompt + output) that contains an owed turn's sequence
as a prefix: one prefill of it, with logprobs from the first owed position, gives every owed
turn on that path its values. A rolled-back branch does not contain the other branch, so it is
its own leaf. The same placement serves a session's next turn, whose prompt is such a path.

Pure functions over ``TurnSequence`` (no I/O), so every placement rule is testable on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..store.turns import TurnSequence


@dataclass(frozen=True)
class OwedTurn:
    """An owed turn on a path: its output starts at absolute position ``n_prompt``."""

    turn_id: str
    n_prompt: int
    n_output: int
    owed: int  # tokens of this turn owed a value
    first: int  # absolute position of its first owed token


@dataclass
class Path:
    """One prefill's worth of owed values: ``input_ids`` with logprobs from ``start`` on."""

    session_id: str
    input_ids: np.ndarray  # the leaf's prompt + output (or the next turn's prompt)
    start: int  # the first owed absolute position (>= 1)
    turns: list[OwedTurn] = field(default_factory=list)
    leaf_turn_id: str | None = None

    @property
    def owed_tokens(self) -> int:
        return sum(t.owed for t in self.turns)


def owed_mask(t: TurnSequence, version: int) -> np.ndarray:
    """Output tokens of ``t`` sampled by ``version - 1`` that have no proximal value yet."""
    return (t.versions == version - 1) & (t.proximal_versions == t.versions)


def is_prefix(a: np.ndarray, b: np.ndarray) -> bool:
    return a.size <= b.size and bool(np.array_equal(b[: a.size], a))


def _owed(turns: list[TurnSequence], version: int) -> list[tuple[TurnSequence, OwedTurn]]:
    out = []
    for t in turns:
        if t.abandoned:  # never handed out (docs/design.md section 11): owes nothing
            continue
        m = owed_mask(t, version)
        if m.any():
            out.append((t, OwedTurn(t.turn_id, t.n_prompt, t.n_output, int(m.sum()), t.n_prompt + int(np.flatnonzero(m)[0]))))
    return out


def plan_leaves(
    session_id: str, turns: list[TurnSequence], version: int, *, min_version: int | None = None
) -> tuple[list[Path], int]:
    """The leaf prefills that settle every owed token of the session under ``version``.

    Owed turns are taken longest first; each not yet covered picks the longest stored sequence
    it is a prefix of (itself at least) as its leaf, and the leaf covers every owed turn whose
    sequence is a prefix of it. With ``min_version`` (``--max-staleness``), a leaf whose path
    holds a token older than ``min_version`` is skipped: its sample will be dropped at pull,
    so its values are never computed. Returns (paths, owed tokens skipped as stale).
    """
    owed = _owed(turns, version)
    if not owed:
        return [], 0
    carriers = sorted(turns, key=lambda t: -t.full.size)  # abandoned turns' tokens still carry a path
    left = {t.turn_id: (t, o) for t, o in owed}
    paths: list[Path] = []
    stale = 0
    for t, _o in sorted(owed, key=lambda x: -x[0].full.size):
        if t.turn_id not in left:
            continue
        leaf = next(c for c in carriers if is_prefix(t.full, c.full))
        on_path = [(u, o) for u, o in left.values() if is_prefix(u.full, leaf.full)]
        for u, _ in on_path:
            del left[u.turn_id]
        path = Path(session_id, leaf.full, min(o.first for _, o in on_path), [o for _, o in on_path], leaf.turn_id)
        if min_version is not None and _oldest_on(turns, leaf.full) < min_version:
            stale += path.owed_tokens
            continue
        paths.append(path)
    return paths, stale


def _oldest_on(turns: list[TurnSequence], full: np.ndarray) -> int:
    """The oldest version among the output tokens of the (delivered) turns on a path."""
    vs = [int(t.versions.min()) for t in turns if not t.abandoned and t.versions.size and is_prefix(t.full, full)]
    return min(vs) if vs else 1 << 30


def plan_prompt(session_id: str, turns: list[TurnSequence], version: int, prompt_ids: list[int]) -> tuple[Path | None, int]:
    """The owed turns a next turn's prompt contains, as one path over the prompt (or None), and
    how many owed tokens of the session lie elsewhere (other branches)."""
    owed = _owed(turns, version)
    if not owed:
        return None, 0
    prompt = np.asarray(prompt_ids, dtype=np.int32)
    inside = [o for t, o in owed if t.full.size < prompt.size and is_prefix(t.full, prompt)]
    elsewhere = sum(o.owed for _t, o in owed) - sum(o.owed for o in inside)
    if not inside:
        return None, elsewhere
    return Path(session_id, prompt, min(o.first for o in inside), inside), elsewhere


def place(path: Path, values: list[float | None], start: int) -> dict[str, list[float | None]]:
    """Per owed turn on ``path``, one value per output token from ``values[j]`` = logprob of
    absolute position ``start + j`` (None where nothing was computed)."""
    out: dict[str, list[float | None]] = {}
    for o in path.turns:
        vals: list[float | None] = []
        for i in range(o.n_output):
            j = o.n_prompt + i - start
            vals.append(values[j] if 0 <= j < len(values) else None)
        out[o.turn_id] = vals
    return out
