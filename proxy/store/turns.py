"""Turns: packed token arrays, prompts stored as shared prefixes, proximal values, the
fingerprints that let a header-less request find its previous turn.

A turn's prompt is stored as "the first N tokens of an earlier turn of the same session (its
prompt + output) + the new tail", so a session of K spliced turns costs O(total tokens), not
O(K * context). Turn rows are written once; recomputed proximal values and the versions still
owed one live in small side tables, so a recompute never rewrites the large token rows.
Measured (tests/proxy/store/test_size.py, whole database incl. indexes): 8.2 bytes per generated
token for one 10k-token turn, 9.2 for 20 spliced turns of 500 tokens.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np
import orjson

from tokenization import id_chain

from .db import Database
from .errors import Conflict, NotFound
from .fingerprints import Candidate, find_candidates, insert_fingerprints
from .group_commit import GroupCommit
from .images import StoredImage, pack_refs, write_images
from .lru import LRU
from .packing import (
    F32,
    I32,
    common_prefix_len,
    fits_i32,
    pack_proximal,
    pack_runs,
    unpack_f32,
    unpack_i32,
    unpack_proximal,
    unpack_runs,
)
from .records import TurnRecord
from .responses import ResponseTable, StoredResponse
from .samples import TurnTokens
from .turn_rows import SELECT, row_record, row_tokens
from .sessions import SessionTable

FULL_IDS_BYTES = 128 << 20  # recent turns' ids by chain buffer: 0.5 MB for 100k tokens, about 256 such sessions


@dataclass(frozen=True)
class TurnSequence:
    """A turn's token sequence and version arrays, without its logprobs or metadata: what the
    R2 leaf planner needs to find which turns lie on which stored path."""

    turn_id: str
    index: int
    n_prompt: int
    full: np.ndarray  # prompt + output ids (int32)
    versions: np.ndarray  # per output token (int32)
    proximal_versions: np.ndarray
    abandoned: bool

    @property
    def n_output(self) -> int:
        return int(self.full.size - self.n_prompt)


class TurnWrite(NamedTuple):
    """A prepared turn: ``write(connection)`` inside a transaction, ``committed()`` after it."""

    write: Callable[[sqlite3.Connection], None]
    committed: Callable[[], None]


class TurnTable:
    def __init__(self, db: Database, sessions: SessionTable, responses: ResponseTable, clock: Callable[[], float] = time.time):
        self.db = db
        self.sessions = sessions
        self.responses = responses
        self.clock = clock
        # turn seq -> prompt+output ids: read-only views of id chains (tokenization/id_chain.py), so
        # a session's turns share one buffer, counted once with its spare room (FULL_IDS_BYTES)
        self._full_ids = LRU(FULL_IDS_BYTES, shared=id_chain.held_memory)
        # turn id -> (seq, n_prompt, role, session), written once, read for every next turn's parent: its
        # ids are found in ``_full_ids`` without a query, and its role without reading a wide row
        # (the column sits past its token arrays' overflow pages)
        self._known = LRU(65536, sized=False)
        self._sampling_ids: dict[bytes, int] = {}  # committed samplings rows: a turn's record is usually one of a few
        self.group = GroupCommit(db)

    # ------------------------------------------------------------ writing

    def add(self, turn: TurnRecord, **parts) -> TurnRecord:
        """Commit a finished turn, in one transaction with what belongs to it: its session
        (created or filled in from ``session_fields`` when given), the history fingerprints that
        lead to it and, for a Responses turn, its stored response. Durable when this returns.
        ``new_images``: images of the prompt that may not be stored yet (stored once per hash);
        ``turn.images`` says where every image of the prompt sits.

        ``turn.index`` < 0 means "the session's next index", assigned inside the transaction.
        Returns the turn as stored.
        """
        pending = self.prepare(turn, **parts)
        with self.db.write() as c:
            pending.write(c)
        pending.committed()
        return turn

    async def add_grouped(self, turn: TurnRecord, *, on_lost: Callable[[], None], alone: bool = False, **parts) -> TurnRecord:
        """``add`` through the group commit (proxy/store/group_commit.py), for the event loop.
        Cancelled before its group's flush, nothing is stored; cancelled after it, the turn stays
        stored and ``on_lost()`` runs (committed, not delivered). ``alone``: committed at once."""
        pending = self.prepare(turn, **parts)
        fut = self.group.submit(pending.write, now=alone)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                pending.committed()
                on_lost()
            raise
        pending.committed()
        return turn

    def prepare(
        self,
        turn: TurnRecord,
        *,
        fingerprints: Sequence[bytes | tuple[bytes, bytes | None]] = (),
        response: StoredResponse | None = None,
        session_fields: dict | None = None,
        new_images: Sequence[StoredImage] = (),
    ) -> "TurnWrite":
        """A turn's writes, checked and packed before any transaction: call the result with an
        open write connection, then ``committed()`` once that transaction has committed."""
        small = (turn.output_ids, turn.versions, turn.proximal_versions)
        if isinstance(turn.prompt_ids, np.ndarray) and turn.prompt_ids.dtype == I32 and all(type(x) is list for x in small):
            # The usual turn: a spliced prompt, already int32, and ids and versions as lists of
            # ints, which numpy (2.x) range-checks as it converts them.
            try:
                out, versions, prox_versions = (np.array(x, dtype=I32) for x in small)
            except OverflowError:
                raise ValueError(f"turn {turn.turn_id}: ids and versions must fit in int32") from None
            prompt = turn.prompt_ids
        else:
            out, versions, prox_versions = (np.asarray(x, dtype=np.int64) for x in small)
            prompt = np.asarray(turn.prompt_ids, dtype=np.int64)
            if not fits_i32(np.concatenate((out, prompt, versions, prox_versions))):
                raise ValueError(f"turn {turn.turn_id}: ids and versions must fit in int32")
            prompt, out = prompt.astype(I32, copy=False), out.astype(I32)
            versions, prox_versions = versions.astype(I32), prox_versions.astype(I32)
        logprobs = np.asarray(turn.output_logprobs, dtype=F32)
        sampling = orjson.dumps(turn.requested_sampling or {}, option=orjson.OPT_SORT_KEYS)
        # The usual new turn: its proximal values are its behaviour ones (nothing recomputed yet).
        # Equal lists with no 0.0 among them (which would equal -0.0) hold the same float32 bits.
        lps, plps, vs, pvs = turn.output_logprobs, turn.proximal_logprobs_t, turn.versions, turn.proximal_versions
        untouched = all(type(x) is list for x in (lps, plps, vs, pvs)) and pvs == vs and plps == lps and 0.0 not in lps
        prox = None if untouched else np.asarray(turn.proximal_logprobs_t, dtype=F32)  # only write_proximal reads it
        done: dict = {}

        def write(c: sqlite3.Connection) -> None:
            if session_fields is not None:
                self.sessions.upsert_in(c, turn.session_id, **session_fields)
            row = c.execute(
                "SELECT closed, (SELECT MAX(idx) FROM turns WHERE session_id = ?1) FROM sessions WHERE session_id = ?1",
                (turn.session_id,),
            ).fetchone()
            if row is None:
                raise NotFound(f"no session {turn.session_id!r} for turn {turn.turn_id}")
            if row[0]:
                raise Conflict(f"session {turn.session_id!r} is closed (reward set); it takes no more turns")
            if turn.index < 0:
                turn.index = 0 if row[1] is None else int(row[1]) + 1
            turn.check()
            sampling_id = self._sampling_ids.get(sampling)
            if sampling_id is None:
                sampling_id = _sampling_id(c, sampling)
            base_seq, base_len = self._pick_prompt_base(c, turn, prompt)
            try:  # the UNIQUE constraints check turn id, (session, index) and item id
                cur = c.execute(
                    "INSERT INTO turns (turn_id, session_id, idx, parent_turn_id, prompt_base, prompt_base_len, "
                    "prompt_tail, n_prompt, n_output, output_ids, logprobs, versions, spliced, fork_reason, "
                    "finish_reason, created_at, sampling_id, drift, api, response_id, role) "
                    "VALUES (" + ",".join("?" * 21) + ")",
                    (
                        turn.turn_id,
                        turn.session_id,
                        turn.index,
                        turn.parent_turn_id,
                        base_seq,
                        base_len,
                        prompt[base_len:].tobytes(),
                        len(prompt),
                        len(out),
                        out.tobytes(),
                        logprobs.tobytes(),
                        pack_runs(turn.versions),
                        int(turn.spliced),
                        turn.fork_reason,
                        turn.finish_reason,
                        turn.created_at,
                        sampling_id,
                        int(turn.drift),
                        turn.api,
                        turn.response_id,
                        turn.role,
                    ),
                )
                seq = cur.lastrowid
                c.execute("INSERT INTO item_ids (item_id, turn_seq) VALUES (?, ?)", (turn.response_id, seq))
            except sqlite3.IntegrityError as exc:
                raise self._duplicate(turn, exc) from None
            if untouched:  # write_proximal's outcome for such a turn: no proximal row, every token pending
                if turn.versions:
                    c.execute("INSERT OR REPLACE INTO pending (turn_seq, vmin, vmax) VALUES (?, ?, ?)",
                              (seq, min(turn.versions), max(turn.versions)))  # fmt: skip
            else:
                write_proximal(c, seq, logprobs, versions, prox, prox_versions, fresh=True)
            if new_images:
                write_images(c, new_images, self.clock())
            if turn.images:
                c.execute("INSERT INTO turn_images (turn_seq, refs) VALUES (?, ?)", (seq, pack_refs(turn.images)))
            if fingerprints:
                insert_fingerprints(c, seq, fingerprints)
            resp_seq = self.responses.insert(c, response, turn.session_id, turn.turn_id) if response is not None else None
            done.update(seq=seq, resp_seq=resp_seq, sampling_id=sampling_id)

        def committed() -> None:
            if len(self._sampling_ids) < 4096:  # committed: the id is real (kept at its size: orjson's bytes hold 4 KB)
                self._sampling_ids[bytes(memoryview(sampling))] = done["sampling_id"]
            # Only after COMMIT: a rolled-back seq may be reused by another turn.
            self._full_ids.put(done["seq"], id_chain.join(prompt, out))  # a spliced prompt: out appended in place
            self._known.put(turn.turn_id, (done["seq"], len(prompt), turn.role, turn.session_id))
            if done["resp_seq"] is not None:
                self.responses.remember(done["resp_seq"], response.conversation)

        return TurnWrite(write, committed)

    @staticmethod
    def _duplicate(turn: TurnRecord, exc: sqlite3.IntegrityError) -> Conflict:
        what = str(exc)
        if "turns.turn_id" in what:
            return Conflict(f"turn {turn.turn_id!r} already stored")
        if "turns.session_id" in what:
            return Conflict(f"session {turn.session_id!r} already has a turn with index {turn.index}")
        if "item_ids.item_id" in what:
            return Conflict(f"id {turn.response_id!r} already names another turn")
        return Conflict(f"turn {turn.turn_id!r} conflicts with a stored one: {what}")

    def abandon(self, turn_id: str) -> None:
        """Mark a committed turn abandoned: its client went away before the answer was sent,
        so no sample ever contains it (docs/design.md section 11). Idempotent."""
        with self.db.write() as c:
            c.execute("INSERT OR IGNORE INTO abandoned (turn_seq) SELECT seq FROM turns WHERE turn_id = ?", (turn_id,))

    def set_drift(self, turn_id: str, drift: bool = True) -> None:
        """Record, after the fact, whether a full re-render would have produced different ids."""
        with self.db.write() as c:
            _set_drift(c, turn_id, drift)

    async def set_drift_grouped(self, turn_id: str, drift: bool = True) -> None:
        """``set_drift`` in the event loop's next group commit: no transaction of its own, and no
        thread holding the write lock that the loop's reads and commits would wait for."""
        await self.group.submit(lambda c: _set_drift(c, turn_id, drift), turn=False)

    def update_proximal(self, turn_id: str, proximal_logprobs_t: list[float], proximal_versions: list[int]) -> None:
        """Replace a turn's proximal arrays (output coordinates) after a recompute; commits."""
        prox = np.asarray(proximal_logprobs_t, dtype=F32)
        if not np.all(np.isfinite(prox)):
            raise ValueError(f"turn {turn_id}: proximal logprobs must be finite")
        if not fits_i32(proximal_versions):
            raise ValueError(f"turn {turn_id}: proximal versions must fit in int32")
        pv = np.asarray(proximal_versions, dtype=I32)
        with self.db.write() as c:
            row = c.execute("SELECT seq, n_output, logprobs, versions FROM turns WHERE turn_id = ?", (turn_id,)).fetchone()
            if row is None:
                raise NotFound(f"no turn {turn_id!r}")
            seq, n, lp_blob, v_blob = row
            if prox.size != n or pv.size != n:
                raise ValueError(f"turn {turn_id}: expected {n} proximal values, got {prox.size} / {pv.size}")
            write_proximal(c, seq, unpack_f32(lp_blob), unpack_runs(v_blob), prox, pv)

    def fill_proximal(self, values: dict[str, list[float | None]], version: int) -> int:
        """Give tokens of ``version - 1`` still lacking a proximal value their ``log pi_version``.

        ``values[turn_id][i]`` is the value for output token ``i`` (None: not computed). Read
        and written in one transaction, so two recomputes of the same tokens (a leaf prefill and
        a next turn's input logprobs) never overwrite each other: the first one wins and both
        carry the same number. Non-finite values are skipped. Returns the tokens that changed.
        """
        owed = int(version) - 1
        changed = 0
        with self.db.write() as c:
            for turn_id, vals in values.items():
                row = c.execute(
                    "SELECT t.seq, t.n_output, t.logprobs, t.versions, p.prox_logprobs, p.prox_versions "
                    "FROM turns t LEFT JOIN proximal p ON p.turn_seq = t.seq WHERE t.turn_id = ?",
                    (turn_id,),
                ).fetchone()
                if row is None:
                    continue  # removed meanwhile: nothing to fill
                seq, n, lp_blob, v_blob, plp_blob, pv_blob = row
                if len(vals) != n:
                    raise ValueError(f"turn {turn_id}: {len(vals)} values for {n} output tokens")
                lp, v = unpack_f32(lp_blob), unpack_runs(v_blob)
                prox, pv = unpack_proximal(lp, v, plp_blob, pv_blob)
                prox, pv = prox.copy(), pv.copy()
                got = np.array([np.nan if x is None else x for x in vals], dtype=np.float64)
                take = (v == owed) & (pv == v) & np.isfinite(got)
                k = int(take.sum())
                if not k:
                    continue
                prox[take] = got[take].astype(F32)
                pv[take] = int(version)
                write_proximal(c, seq, lp, v, prox, pv)
                changed += k
        return changed

    # ------------------------------------------------------------ reading

    def tokens_of(self, session_id: str) -> list[TurnSequence]:
        """Every turn of the session (index order) as token sequences and version arrays."""
        with self.db.read(snapshot=True) as c:
            rows = c.execute(
                "SELECT t.seq, t.turn_id, t.idx, t.n_prompt, t.versions, p.prox_versions, "
                "EXISTS (SELECT 1 FROM abandoned a WHERE a.turn_seq = t.seq) "
                "FROM turns t LEFT JOIN proximal p ON p.turn_seq = t.seq WHERE t.session_id = ? ORDER BY t.idx",
                (session_id,),
            ).fetchall()
            out = []
            for seq, turn_id, idx, n_prompt, v_blob, pv_blob, abandoned in rows:
                v = unpack_runs(v_blob)
                pv = v if pv_blob is None else unpack_runs(pv_blob)
                out.append(TurnSequence(turn_id, idx, n_prompt, self._full_sequence(c, seq), v, pv, bool(abandoned)))
            return out

    def owed_sessions(self, version: int, *, closed_only: bool = False) -> list[str]:
        """Sessions holding tokens owed a value under ``version`` (see ``owed``), oldest first;
        with ``closed_only`` only rewarded ones (they will send no further turn)."""
        with self.db.read(snapshot=True) as c:
            rows = _owed_rows(c, version, light=True, closed_only=closed_only)
        return list(dict.fromkeys(r[3] for r in rows))

    def owed_tokens(self, version: int) -> int:
        """How many tokens are owed a value under ``version`` (for counting missing values)."""
        owed = version - 1
        n = 0
        with self.db.read(snapshot=True) as c:
            for r in _owed_rows(c, version, light=True):
                versions = unpack_runs(r[1])
                pv = versions if r[2] is None else unpack_runs(r[2])
                n += int(np.sum((versions == owed) & (pv == versions)))
        return n


    def get(self, turn_id: str) -> TurnRecord | None:
        with self.db.read() as c:
            row = c.execute(SELECT + "WHERE t.turn_id = ?", (turn_id,)).fetchone()
            return None if row is None else self._from_rows(c, [row])[0]

    def session_of(self, turn_id: str) -> str | None:
        with self.db.read() as c:
            row = c.execute("SELECT session_id FROM turns WHERE turn_id = ?", (turn_id,)).fetchone()
            return None if row is None else row[0]

    def ids(self, turn_id: str) -> tuple[np.ndarray, np.ndarray] | None:
        """(prompt ids, output ids) of a turn: what the next spliced turn builds on. Read-only
        int32 views of the cached sequence: no per-token copy, however long the session."""
        known = self._known.get(turn_id)
        full = None if known is None else self._full_ids.get(known[0])
        if full is not None:
            return _halves(full, known[1])
        with self.db.read() as c:
            known = self._look_up(c, turn_id)
            return None if known is None else _halves(self._full_sequence(c, known[0]), known[1])

    def first_of_role(self, session_id: str, role: str) -> tuple[str, dict] | None:
        """``(turn_id, requested_sampling)`` of the session's first turn of ``role``: what
        classifying a new turn's role compares against (proxy.session.roles). No token arrays."""
        with self.db.read() as c:
            row = c.execute(
                "SELECT t.turn_id, sm.json FROM turns t JOIN samplings sm ON sm.id = t.sampling_id "
                "WHERE t.session_id = ? AND t.role = ? ORDER BY t.idx LIMIT 1",
                (session_id, role),
            ).fetchone()
        return None if row is None else (row[0], orjson.loads(row[1]))

    def role_of(self, turn_id: str) -> str | None:
        known = self._known.get(turn_id)
        if known is None:
            with self.db.read() as c:
                known = self._look_up(c, turn_id)
        return None if known is None else known[2]

    def _look_up(self, c, turn_id: str) -> tuple[int, int, str, str] | None:
        """``(seq, n_prompt, role, session_id)`` of a turn from its row, kept in ``_known``."""
        row = c.execute("SELECT seq, n_prompt, role, session_id FROM turns WHERE turn_id = ?", (turn_id,)).fetchone()
        if row is not None:
            self._known.put(turn_id, tuple(row))
        return row

    def latest_summary(self, session_id: str) -> str | None:
        """The id of the session's latest compaction summary turn (``requested_sampling.compaction``)."""
        with self.db.read() as c:
            row = c.execute(
                "SELECT t.turn_id FROM turns t JOIN samplings sm ON sm.id = t.sampling_id "
                "WHERE t.session_id = ? AND instr(sm.json, ?) > 0 ORDER BY t.idx DESC LIMIT 1",
                (session_id, b'"compaction":"summary"'),
            ).fetchone()
        return None if row is None else row[0]

    def list(self, session_id: str) -> list[TurnRecord]:
        """Every turn of the session in index order (empty for an unknown session)."""
        with self.db.read(snapshot=True) as c:
            return self.list_in(c, session_id)

    def list_in(self, c, session_id: str) -> list[TurnRecord]:
        rows = c.execute(SELECT + "WHERE t.session_id = ? ORDER BY t.seq", (session_id,)).fetchall()
        prompts = self._decode_prompts(c, [(r[0], r[5], r[6], r[7], r[9]) for r in rows])
        turns = [row_record(r, prompts[r[0]][0]) for r in rows]
        return sorted(turns, key=lambda t: t.index)

    def iter_tokens(self, c, session_id: str) -> Iterator[TurnTokens]:
        """Every turn of the session as NumPy arrays, in index order, decoded one at a time.

        A prompt is rebuilt from its base (an earlier turn's prompt + output) and its tail; a
        base is kept only until its last user is decoded, so a pull of a session of K turns
        holds O(context) tokens, not O(K * context). Nothing goes into the prompt cache: a
        rewarded session's turns are read once, by the pull.
        """
        rows = c.execute(SELECT + "WHERE t.session_id = ? ORDER BY t.seq", (session_id,)).fetchall()
        if any(a[3] > b[3] for a, b in zip(rows, rows[1:])):  # indices given out of commit order (tests, imports)
            decoded = self._decode_prompts(c, [(r[0], r[5], r[6], r[7], r[9]) for r in rows])
            yield from sorted((row_tokens(r, decoded[r[0]][0]) for r in rows), key=lambda t: t.index)
            return
        last_use = {r[5]: i for i, r in enumerate(rows) if r[5] is not None}
        full: dict[int, np.ndarray] = {}
        for i, row in enumerate(rows):
            seq, base, base_len, tail, output_ids = row[0], row[5], row[6], row[7], row[9]
            if base is None:
                head = np.empty(0, dtype=I32)
            else:
                head = (full[base] if base in full else self._full_sequence(c, base))[:base_len]
                if last_use[base] == i:
                    full.pop(base, None)
            prompt = np.concatenate([head, unpack_i32(tail)])
            if last_use.get(seq, -1) > i:
                full[seq] = np.concatenate([prompt, unpack_i32(output_ids)])
            yield row_tokens(row, prompt)

    def candidates(self, fingerprint: bytes, variant: bytes | None = None, limit: int = 64) -> list[Candidate]:
        """Recorded turns a history fingerprint leads to (``fingerprints.find_candidates``)."""
        with self.db.read() as c:
            return find_candidates(c, fingerprint, variant, limit)

    def owed(self, version: int) -> list[TurnRecord]:
        """Turns of not-yet-acked sessions holding tokens of ``version - 1`` with no proximal value yet (R2)."""
        with self.db.read(snapshot=True) as c:
            return self._from_rows(c, _owed_rows(c, version))

    def owed_ids(self, version: int) -> list[str]:
        """The ids of ``owed(version)``, oldest first, without decoding any tokens: a recompute
        loads one turn at a time, so its memory does not grow with how much is owed."""
        with self.db.read(snapshot=True) as c:
            return [turn_id for turn_id, *_ in _owed_rows(c, version, light=True)]

    def owed_count(self, version: int) -> int:
        """``len(owed(version))`` without decoding prompts (for status pages)."""
        with self.db.read(snapshot=True) as c:
            return len(_owed_rows(c, version, light=True))

    # ------------------------------------------------------------ prompt prefixes

    def _parent_base(self, turn: TurnRecord, prompt: np.ndarray) -> tuple[int, int] | None:
        """(parent seq, its length) when the prompt extends the ids of a parent of its session (one id chain)."""
        known = self._known.get(turn.parent_turn_id) if turn.parent_turn_id else None
        full = self._full_ids.get(known[0]) if known is not None and known[3] == turn.session_id else None
        if full is not None and full.size >= 8 and id_chain.known_prefix(full, prompt):
            return known[0], full.size
        return None

    def _pick_prompt_base(self, c, turn: TurnRecord, prompt: np.ndarray) -> tuple[int | None, int]:
        """The earlier turn of the session whose prompt+output shares the longest prefix with this prompt."""
        if (parent := self._parent_base(turn, prompt)) is not None:  # a splice: no query, no compare
            return parent
        rows = c.execute(
            "SELECT seq FROM turns WHERE session_id = ? AND (turn_id = ? OR seq = "
            "(SELECT MAX(seq) FROM turns WHERE session_id = ?))",
            (turn.session_id, turn.parent_turn_id or "", turn.session_id),
        ).fetchall()
        best: tuple[int | None, int] = (None, 0)
        for (seq,) in rows:
            shared = common_prefix_len(self._full_sequence(c, seq), prompt)
            if shared > best[1]:
                best = (seq, shared)
        return best if best[1] >= 8 else (None, 0)

    def _full_sequence(self, c, seq: int) -> np.ndarray:
        """prompt + output ids of the turn ``seq``, rebuilding its session's base chain on a cache miss."""
        hit = self._full_ids.get(seq)
        if hit is not None:
            return hit
        session_id = c.execute("SELECT session_id FROM turns WHERE seq = ?", (seq,)).fetchone()[0]
        rows = c.execute(
            "SELECT seq, prompt_base, prompt_base_len, prompt_tail, output_ids FROM turns "
            "WHERE session_id = ? AND seq <= ? ORDER BY seq",
            (session_id, seq),
        ).fetchall()
        return self._decode_prompts(c, rows)[seq][1]

    def _decode_prompts(self, c, rows) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """seq -> (prompt, prompt+output) for rows of one session given in seq order."""
        out: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for seq, base, base_len, tail, output_ids in rows:
            if base is None:
                head = np.empty(0, dtype=I32)
            else:
                full = out[base][1] if base in out else self._full_sequence(c, base)
                head = full[:base_len]
            prompt = np.concatenate([head, unpack_i32(tail)])
            full_seq = np.concatenate([prompt, unpack_i32(output_ids)])
            out[seq] = (prompt, full_seq)
            self._full_ids.put(seq, full_seq)
        return out

    def _from_rows(self, c, rows) -> list[TurnRecord]:
        """Decode full turn rows (any sessions), rebuilding prompts from their bases."""
        result = []
        for row in rows:
            seq, base, base_len, tail = row[0], row[5], row[6], row[7]
            head = np.empty(0, dtype=I32) if base is None else self._full_sequence(c, base)[:base_len]
            prompt = np.concatenate([head, unpack_i32(tail)])
            self._full_ids.put(seq, np.concatenate([prompt, unpack_i32(row[9])]))
            result.append(row_record(row, prompt))
        return result


def _set_drift(c: sqlite3.Connection, turn_id: str, drift: bool) -> None:
    if c.execute("UPDATE turns SET drift = ? WHERE turn_id = ?", (int(drift), turn_id)).rowcount == 0:
        raise NotFound(f"no turn {turn_id!r}")


def _halves(full: np.ndarray, n_prompt: int) -> tuple[np.ndarray, np.ndarray]:
    full = full.view()
    full.flags.writeable = False
    return full[:n_prompt], full[n_prompt:]


def _sampling_id(c, blob: bytes) -> int:
    row = c.execute("SELECT id FROM samplings WHERE json = ?", (blob,)).fetchone()
    return row[0] if row else c.execute("INSERT INTO samplings (json) VALUES (?)", (blob,)).lastrowid


def write_proximal(c, seq: int, logprobs, versions, prox, prox_versions, *, fresh: bool = False) -> None:
    """Store what differs from the behaviour arrays, and which versions still lack a value.
    ``fresh``: ``seq`` was just inserted, so it has no rows here to replace."""
    prox_blob, pv_blob = pack_proximal(logprobs, versions, prox, prox_versions)
    if prox_blob is None and pv_blob is None:
        if not fresh:
            c.execute("DELETE FROM proximal WHERE turn_seq = ?", (seq,))
    else:
        c.execute(
            "INSERT OR REPLACE INTO proximal (turn_seq, prox_logprobs, prox_versions) VALUES (?, ?, ?)",
            (seq, prox_blob, pv_blob),
        )
    pending = versions[prox_versions == versions]
    if pending.size:
        c.execute(
            "INSERT OR REPLACE INTO pending (turn_seq, vmin, vmax) VALUES (?, ?, ?)",
            (seq, int(pending.min()), int(pending.max())),
        )
    elif not fresh:
        c.execute("DELETE FROM pending WHERE turn_seq = ?", (seq,))


def _owed_rows(c, version: int, *, light: bool = False, closed_only: bool = False) -> list:
    """Owed turns' full rows, or with ``light`` only ``(turn_id, versions, prox_versions, session_id)``."""
    owed = version - 1
    head = (
        "SELECT t.turn_id, t.versions, p.prox_versions, t.session_id FROM turns t LEFT JOIN proximal p ON p.turn_seq = t.seq "
        if light
        else SELECT
    )
    rows = c.execute(
        head + "JOIN pending q ON q.turn_seq = t.seq JOIN sessions s ON s.session_id = t.session_id "
        "WHERE q.vmax >= ? AND q.vmin <= ? AND s.acked = 0 " + ("AND s.closed = 1 " if closed_only else "") +
        "AND NOT EXISTS (SELECT 1 FROM abandoned a WHERE a.turn_seq = t.seq) ORDER BY t.seq",
        (owed, owed),
    ).fetchall()
    vi, pi = (1, 2) if light else (11, 13)
    result = []
    for r in rows:  # the columns only bound the versions; check token by token
        versions = unpack_runs(r[vi])
        pv = versions if r[pi] is None else unpack_runs(r[pi])
        if np.any((versions == owed) & (pv == versions)):
            result.append(r)
    return result
