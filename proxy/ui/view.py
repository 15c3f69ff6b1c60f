"""One session as the viewer shows it: its turn tree, its samples, and their tokens by pages.

The token arrays are the samples the trainer would pull (``assemble_samples`` over the stored
turns): context tokens the proxy added between turns (``bridge``: new prompt tails, template
tokens, tool results; loss mask 0) and the tokens each turn sampled (mask 1), with their
versions and behaviour / proximal log-probs. A session is assembled once per change (a small
LRU keyed by what the store holds for it) and handed out a page at a time, so a 100k-token
session costs one assembly and a page of decoded text per request.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import orjson

from ..store import Store
from ..store.packing import unpack_runs
from ..store.records import SessionRecord
from ..store.samples import Sample, assemble_samples

MAX_PAGE = 8192

# token segment codes (``seg`` of a page)
TEXT, REASONING, TOOL, SPECIAL, IMAGE = 0, 1, 2, 3, 4


@dataclass
class TurnMeta:
    turn_id: str
    index: int
    parent_turn_id: str | None
    spliced: bool
    fork_reason: str | None
    finish_reason: str
    created_at: float
    n_prompt: int
    n_output: int
    drift: bool
    api: str
    abandoned: bool
    vmin: int | None
    vmax: int | None
    sampling: dict
    role: str = "main"  # the episode role the turn was recorded with (proxy.session.roles)

    @property
    def edge(self) -> str:
        """How the turn hangs off its parent: ``spliced`` (verbatim ids), ``fork`` (a full
        render, see ``fork_reason``) or ``root`` (a session's first turn)."""
        if self.spliced:
            return "spliced"
        return "fork" if self.fork_reason else "root"

    def to_dict(self) -> dict:
        return {
            "turn_id": self.turn_id,
            "index": self.index,
            "parent_turn_id": self.parent_turn_id,
            "edge": self.edge,
            "spliced": self.spliced,
            "fork_reason": self.fork_reason,
            "finish_reason": self.finish_reason,
            "created_at": self.created_at,
            "n_prompt": self.n_prompt,
            "n_output": self.n_output,
            "drift": self.drift,
            "api": self.api,
            "abandoned": self.abandoned,
            "version_min": self.vmin,
            "version_max": self.vmax,
            "engine_id": self.sampling.get("engine_id"),
            "model": self.sampling.get("model"),
            "trainable": self.sampling.get("trainable") is not False,
            "role": self.role,
        }


@dataclass
class SessionView:
    session: SessionRecord
    turns: list[TurnMeta]
    samples: list[Sample]
    owners: list[np.ndarray]  # per sample: index of the turn each token belongs to (int32)
    src: list[np.ndarray]  # per sample: 0 bridge (context), 1 sampled (uint8)
    segs: list[np.ndarray]  # per sample: TEXT / REASONING / TOOL / SPECIAL / IMAGE (uint8)
    pulled: list[bool]  # per sample: whether a pull hands it out (side calls are shown, not pulled)


_TURNS = (
    "SELECT t.turn_id, t.idx, t.parent_turn_id, t.spliced, t.fork_reason, t.finish_reason, t.created_at, "
    "t.n_prompt, t.n_output, t.drift, t.api, EXISTS (SELECT 1 FROM abandoned a WHERE a.turn_seq = t.seq), "
    "t.versions, sm.json, t.role FROM turns t JOIN samplings sm ON sm.id = t.sampling_id WHERE t.session_id = ? ORDER BY t.idx"
)
_STAMP = (
    "SELECT COUNT(*), MAX(t.seq), MAX(p.id), (SELECT COUNT(*) FROM abandoned a JOIN turns k ON k.seq = a.turn_seq "
    "WHERE k.session_id = ?) FROM turns t LEFT JOIN proximal p ON p.turn_seq = t.seq WHERE t.session_id = ?"
)


class Segmenter:
    """Which tokens are reasoning, tool calls, template specials: from the tokenizer's own
    marker tokens (``<think>``, ``<tool_call>``, ...), vectorised over a whole sample."""

    PAIRS = {REASONING: ("<think>", "</think>"), TOOL: ("<tool_call>", "</tool_call>")}

    def __init__(self, tokenizer):
        vocab = tokenizer.get_vocab()
        self.pairs = {
            code: (vocab[a], vocab[b]) for code, (a, b) in self.PAIRS.items() if a in vocab and b in vocab
        }
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        special |= {i for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items() if getattr(t, "special", False)}
        self.special = np.array(sorted(special), dtype=np.int64)

    def segments(self, ids: np.ndarray, images) -> np.ndarray:
        seg = np.zeros(ids.size, np.uint8)
        for code, (open_id, close_id) in self.pairs.items():
            depth = np.cumsum((ids == open_id).astype(np.int32) - (ids == close_id).astype(np.int32))
            inside = (depth > 0) | (ids == close_id)
            seg[inside] = code
        if self.special.size:
            seg[np.isin(ids, self.special)] = SPECIAL
        for im in images:
            seg[im.offset : im.offset + im.length] = IMAGE
        return seg


class ViewCache:
    """Assembled sessions, newest use last; an entry is reused while the store's stamp for its
    session (turn count, last turn, last proximal write, abandoned turns) is unchanged."""

    def __init__(self, store: Store, segmenter: Segmenter, entries: int = 8):
        self.store = store
        self.segmenter = segmenter
        self.entries = entries
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, tuple[tuple, SessionView]] = OrderedDict()

    def get(self, session_id: str) -> SessionView | None:
        """The session's view (blocking; call from a worker thread); None if there is no such session."""
        with self.store.db.read(snapshot=True) as c:
            session = self.store.sessions.get(session_id)
            if session is None:
                return None
            stamp = tuple(c.execute(_STAMP, (session_id, session_id)).fetchone()) + (session.reward, session.acked, session.lease_id)
            with self._lock:
                hit = self._cache.get(session_id)
                if hit is not None and hit[0] == stamp:
                    self._cache.move_to_end(session_id)
                    return hit[1]
            view = self._build(c, session)
        with self._lock:
            self._cache[session_id] = (stamp, view)
            self._cache.move_to_end(session_id)
            while len(self._cache) > self.entries:
                self._cache.popitem(last=False)
        return view

    def _build(self, c, session: SessionRecord) -> SessionView:
        turns = []
        for (tid, idx, parent, spliced, fork, finish, created, n_prompt, n_output, drift, api, abandoned, vblob,
             sampling, role) in c.execute(_TURNS, (session.session_id,)):  # fmt: skip
            v = unpack_runs(vblob)
            turns.append(
                TurnMeta(tid, idx, parent, bool(spliced), fork, finish, created, n_prompt, n_output, bool(drift), api,
                         bool(abandoned), int(v.min()) if v.size else None, int(v.max()) if v.size else None,
                         orjson.loads(sampling), role)
            )  # fmt: skip
        sid = session.session_id
        aux_pulled = self.store.pool.auxiliary_pulled(c, sid)
        samples = assemble_samples(session, self.store.turns.iter_tokens(c, sid), train_auxiliary=aux_pulled)
        pulled = [True] * len(samples)
        if not aux_pulled and any(t.role == "auxiliary" and not t.abandoned for t in turns):
            # side calls a pull leaves out: shown after the pulled samples, under ids of their own
            aux = (t for t in self.store.turns.iter_tokens(c, sid) if t.role == "auxiliary")
            side = assemble_samples(session, aux, train_auxiliary=True)
            for k, s in enumerate(side):
                s.sample_id = f"{sid}:side{k}"
            samples += side
            pulled += [False] * len(side)
        by_id = {t.turn_id: k for k, t in enumerate(turns)}
        owners, srcs, segs = [], [], []
        for s in samples:
            n = len(s)
            owner = np.zeros(n, np.int32)
            src = np.zeros(n, np.uint8)
            for span in s.turns:
                owner[span.context_start : span.start + span.length] = by_id.get(span.turn_id, -1)
                src[span.start : span.start + span.length] = 1
            owners.append(owner)
            srcs.append(src)
            segs.append(self.segmenter.segments(s.input_ids, s.images))
        return SessionView(session, turns, samples, owners, srcs, segs, pulled)


class Pieces:
    """Token id -> its text, decoded alone (cached: the vocabulary bounds it)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, ids) -> list[str]:
        cache = self._cache
        out = []
        for i in ids:
            i = int(i)
            piece = cache.get(i)
            if piece is None:
                piece = cache[i] = self.tokenizer.decode([i], skip_special_tokens=False)
            out.append(piece)
        return out


def summary(view: SessionView, version: int) -> dict:
    """The session page's head: the session, its turn tree and its samples (no token arrays)."""
    turns = [t.to_dict() for t in view.turns]
    placed: dict[str, dict] = {}
    samples = []
    for k, s in enumerate(view.samples):
        spans = []
        for span in s.turns:
            placed[span.turn_id] = {"sample": k, "context_start": span.context_start, "start": span.start, "length": span.length}
            spans.append({"turn_id": span.turn_id, "index": span.index, "context_start": span.context_start,
                          "start": span.start, "length": span.length})  # fmt: skip
        versions = s.versions[s.loss_mask.astype(bool)]
        samples.append(
            {
                "sample_id": s.sample_id,
                "n_tokens": len(s),
                "loss_tokens": int(s.loss_mask.sum()),
                "trainable": bool(s.trainable),
                "role": s.role,
                "pulled": view.pulled[k],
                "reward": s.reward,
                "turns": spans,
                "images": [r.to_dict() for r in s.images],
                "version_min": int(versions.min()) if versions.size else None,
                "version_max": int(versions.max()) if versions.size else None,
            }
        )
    for t in turns:
        t["placement"] = placed.get(t["turn_id"])
    forks: dict[str, int] = {}
    roles: dict[str, int] = {}
    for t in view.turns:
        if t.fork_reason:
            forks[t.fork_reason] = forks.get(t.fork_reason, 0) + 1
        roles[t.role] = roles.get(t.role, 0) + 1
    return {
        "session": view.session.to_dict(),
        "version": version,
        "turns": turns,
        "samples": samples,
        "forks": forks,
        "roles": roles,
        "n_tokens": sum(len(s) for s in view.samples),
    }


def _f(a: np.ndarray) -> list:
    """float32 values widened to float64: the same text ``GET /v1/sessions/{id}`` writes."""
    return a.astype(np.float64).tolist()


def page(view: SessionView, pieces: Pieces, sample: int, start: int, count: int) -> dict:
    """Tokens ``[start, start + count)`` of one sample, column by column."""
    s = view.samples[sample]
    n = len(s)
    start = max(0, min(int(start), n))
    end = min(n, start + max(0, min(int(count), MAX_PAGE)))
    sl = slice(start, end)
    ids = s.input_ids[sl]
    images = [r.to_dict() for r in s.images if r.offset < end and r.offset + r.length > start]
    return {
        "sample": sample,
        "start": start,
        "end": end,
        "n_tokens": n,
        "ids": ids.tolist(),
        "text": pieces(ids),
        "turn": view.owners[sample][sl].tolist(),
        "src": view.src[sample][sl].tolist(),
        "seg": view.segs[sample][sl].tolist(),
        "mask": s.loss_mask[sl].tolist(),
        "version": s.versions[sl].tolist(),
        "logprob": _f(s.logprobs[sl]),
        "proximal": _f(s.proximal_logprobs_t[sl]),
        "proximal_version": s.proximal_versions[sl].tolist(),
        "images": images,
    }


def overview(view: SessionView, sample: int, buckets: int) -> dict:
    """A whole sample in at most ``buckets`` runs of tokens, one figure per channel each: the
    newest version sampled in it (-1: none), the lowest behaviour log-prob, the proximal −
    behaviour difference of largest size, the share of trained and of sampled tokens. Lets the
    page show where a weight update or a mismatch lies in a 100k-token sample at a glance."""
    s = view.samples[sample]
    n = len(s)
    b = max(1, min(int(buckets), n))
    starts = np.linspace(0, n, b + 1).astype(np.int64)[:-1]
    sampled = view.src[sample].astype(bool)
    neg = np.float32(np.inf)
    version = np.maximum.reduceat(np.where(sampled, s.versions, -1), starts) if n else np.empty(0)
    low = np.minimum.reduceat(np.where(sampled, s.logprobs, neg), starts) if n else np.empty(0)
    diff = np.where(sampled, s.proximal_logprobs_t - s.logprobs, 0).astype(np.float64)
    hi = np.maximum.reduceat(diff, starts) if n else np.empty(0)
    lo = np.minimum.reduceat(diff, starts) if n else np.empty(0)
    counts = np.diff(np.append(starts, n))
    return {
        "sample": sample,
        "n_tokens": n,
        "starts": starts.tolist(),
        "version": version.tolist(),
        "logprob": [None if not np.isfinite(x) else float(x) for x in low],
        "delta": np.where(np.abs(hi) >= np.abs(lo), hi, lo).tolist(),
        "mask": (np.add.reduceat(s.loss_mask.astype(np.int64), starts) / counts).tolist() if n else [],
        "src": (np.add.reduceat(sampled.astype(np.int64), starts) / counts).tolist() if n else [],
    }
