"""The durable store: sessions, turns, stored responses, id lookups and trainer leases in SQLite.

Durability: the database runs in WAL mode and every write method commits before it returns.
With ``synchronous=NORMAL`` (the default) a commit is in the WAL file, i.e. in the operating
system's page cache, when the call returns, so it survives ``kill -9`` or a crash of the
proxy process; only a power loss or kernel crash can drop the last commits. Pass
``synchronous="FULL"`` to fsync every commit when that matters more than latency.

Size: token arrays are packed, never JSON. Ids are int32 and logprobs float32 (4 + 4 bytes per
generated token); versions are run-length encoded (one run per weight version a turn saw);
proximal values are stored only where they differ from the behaviour logprob (NULL until a
recompute); a turn's prompt is stored as "the first N tokens of an earlier turn of the same
session (its prompt + output) + the new tail", so a session of K spliced turns costs O(total
tokens), not O(K * context). Stored conversations of responses are delta-encoded likewise.
Turn rows are written once; recomputed proximal values and the versions still owed one live in
small side tables, so a recompute does not rewrite and fragment the token rows. Measured
(tests/store/test_size.py, whole database incl. indexes and id lookups): 8.2 bytes per
generated token for one 10k-token turn, 9.2 for 20 spliced turns of 500 tokens, 13.5 once
every token also has a recomputed proximal logprob.

Thread safety: one connection guarded by a lock; every call is a short transaction, so the
asyncio app calls these methods directly.
"""

from __future__ import annotations

from collections.abc import Sequence

import math
import os
import sqlite3
import threading
import time
import uuid
import zlib
from collections import OrderedDict
from contextlib import contextmanager
from typing import Callable, Iterator

import numpy as np
import orjson

from proxy import pool_ledger
from proxy.records import SessionRecord, TurnRecord
from proxy.samples import assemble_samples

SCHEMA_VERSION = 2


class StoreError(Exception):
    """Base class of store errors."""


class NotFound(StoreError):
    """The named session, turn, response or lease does not exist (HTTP 404)."""


class Conflict(StoreError):
    """The request contradicts what is stored (HTTP 409): a second reward, a duplicate id, an expired lease."""


# ---------------------------------------------------------------- packing

_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")


def pack_i32(values) -> bytes:
    """int32 little-endian; raises OverflowError for values outside int32."""
    if not _fits_i32(values):
        raise OverflowError("token id or version outside int32")
    return np.asarray(values, dtype=np.int64).astype(_I32).tobytes()


def _fits_i32(values) -> bool:
    a = np.asarray(values, dtype=np.int64)
    return a.size == 0 or (int(a.min()) >= -(2**31) and int(a.max()) < 2**31)


def unpack_i32(blob: bytes | None) -> np.ndarray:
    return np.frombuffer(blob or b"", dtype=_I32)


def pack_f32(values) -> bytes:
    return np.asarray(values, dtype=_F32).tobytes()


def unpack_f32(blob: bytes | None) -> np.ndarray:
    return np.frombuffer(blob or b"", dtype=_F32)


def pack_runs(values) -> bytes:
    """Run-length encode ints as int32 (value, count) pairs: versions are long runs of one value."""
    a = np.asarray(values, dtype=np.int64)
    if a.size == 0:
        return b""
    starts = np.flatnonzero(np.concatenate(([True], a[1:] != a[:-1])))
    counts = np.diff(np.append(starts, a.size))
    return pack_i32(np.stack([a[starts], counts], axis=1).ravel())


def unpack_runs(blob: bytes | None) -> np.ndarray:
    pairs = unpack_i32(blob).reshape(-1, 2)
    return np.repeat(pairs[:, 0], pairs[:, 1]).astype(_I32)


def pack_proximal(
    logprobs: np.ndarray, versions: np.ndarray, prox: np.ndarray, prox_versions: np.ndarray
) -> tuple[bytes | None, bytes | None]:
    """Encode proximal arrays against the behaviour arrays; (None, None) while nothing was recomputed.

    Logprob blob: ``b"S"`` + float32 values only at positions whose proximal version differs
    from the token version (elsewhere the proximal value is the behaviour logprob, SPEC 2), or
    ``b"D"`` + every value when a caller broke that rule (kept exactly rather than "fixed").
    """
    pv_blob = None if np.array_equal(prox_versions, versions) else pack_runs(prox_versions)
    lp_bits, prox_bits = logprobs.view(np.int32), prox.view(np.int32)
    if np.array_equal(lp_bits, prox_bits):
        return None, pv_blob
    changed = prox_versions != versions
    if np.array_equal(lp_bits[~changed], prox_bits[~changed]):
        return b"S" + prox[changed].tobytes(), pv_blob
    return b"D" + prox.tobytes(), pv_blob


def unpack_proximal(
    logprobs: np.ndarray, versions: np.ndarray, lp_blob: bytes | None, pv_blob: bytes | None
) -> tuple[np.ndarray, np.ndarray]:
    prox_versions = versions if pv_blob is None else unpack_runs(pv_blob)
    if lp_blob is None:
        return logprobs, prox_versions
    if lp_blob[:1] == b"D":
        return unpack_f32(lp_blob[1:]), prox_versions
    prox = logprobs.copy()
    prox[prox_versions != versions] = unpack_f32(lp_blob[1:])
    return prox, prox_versions


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


# ---------------------------------------------------------------- schema

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    session_id  TEXT PRIMARY KEY,
    group_id    TEXT,
    group_size  INTEGER,
    reward      REAL,
    closed      INTEGER NOT NULL DEFAULT 0,
    created_at  REAL NOT NULL,
    rewarded_at REAL,
    metadata    BLOB,
    lease_id    TEXT,
    acked       INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS sessions_ready ON sessions(rewarded_at) WHERE reward IS NOT NULL AND acked = 0;
CREATE INDEX IF NOT EXISTS sessions_group ON sessions(group_id) WHERE group_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS sessions_lease ON sessions(lease_id) WHERE lease_id IS NOT NULL;

CREATE TABLE IF NOT EXISTS turns (
    seq             INTEGER PRIMARY KEY,  -- insertion order; prompt bases always have a smaller seq
    turn_id         TEXT NOT NULL UNIQUE,
    session_id      TEXT NOT NULL,
    idx             INTEGER NOT NULL,
    parent_turn_id  TEXT,
    prompt_base     INTEGER,              -- seq of the turn whose prompt+output the prompt starts with
    prompt_base_len INTEGER NOT NULL,
    prompt_tail     BLOB NOT NULL,        -- int32 prompt ids after the base prefix
    n_prompt        INTEGER NOT NULL,
    n_output        INTEGER NOT NULL,
    output_ids      BLOB NOT NULL,        -- int32
    logprobs        BLOB NOT NULL,        -- float32
    versions        BLOB NOT NULL,        -- int32 (value, run length) pairs
    spliced         INTEGER NOT NULL,
    fork_reason     TEXT,
    finish_reason   TEXT NOT NULL,
    created_at      REAL NOT NULL,
    sampling_id     INTEGER NOT NULL,     -- samplings.id: requested_sampling, interned
    drift           INTEGER NOT NULL,
    api             TEXT NOT NULL,
    response_id     TEXT NOT NULL,
    UNIQUE (session_id, idx)
);

-- Turn rows are written once; what changes later lives in small side tables, so a recompute
-- never rewrites (and fragments) the large token rows.
CREATE TABLE IF NOT EXISTS proximal (
    id            INTEGER PRIMARY KEY,    -- a replaced row gets a new id: appends pack pages densely
    turn_seq      INTEGER NOT NULL UNIQUE,
    prox_logprobs BLOB,                   -- NULL: equal to logprobs; see pack_proximal
    prox_versions BLOB                    -- NULL: equal to versions; else runs
);
CREATE TABLE IF NOT EXISTS pending (     -- turns with tokens still lacking a proximal value
    turn_seq INTEGER PRIMARY KEY,
    vmin     INTEGER NOT NULL,            -- min / max version among those tokens
    vmax     INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS pending_vmax ON pending(vmax);
CREATE TABLE IF NOT EXISTS samplings (
    id   INTEGER PRIMARY KEY,
    json BLOB NOT NULL UNIQUE
);

CREATE TABLE IF NOT EXISTS item_ids (
    item_id  TEXT PRIMARY KEY,
    turn_seq INTEGER NOT NULL
) WITHOUT ROWID;

CREATE TABLE IF NOT EXISTS fingerprints (
    fp       TEXT PRIMARY KEY,
    turn_seq INTEGER NOT NULL
) WITHOUT ROWID;

CREATE TABLE IF NOT EXISTS responses (
    seq           INTEGER PRIMARY KEY,
    response_id   TEXT NOT NULL UNIQUE,
    session_id    TEXT NOT NULL,
    turn_id       TEXT,
    created_at    REAL NOT NULL,
    body          BLOB NOT NULL,          -- zlib
    conv_base     INTEGER,                -- seq of the response whose conversation this one extends
    conv_base_len INTEGER NOT NULL,
    conv_tail     BLOB NOT NULL,          -- zlib of the bytes after the shared prefix
    conv_depth    INTEGER NOT NULL        -- chain length to a full copy (bounded)
);
CREATE INDEX IF NOT EXISTS responses_session ON responses(session_id, seq);
"""

_TURN_SELECT = (
    "SELECT t.seq, t.turn_id, t.session_id, t.idx, t.parent_turn_id, t.prompt_base, t.prompt_base_len, "
    "t.prompt_tail, t.n_output, t.output_ids, t.logprobs, t.versions, p.prox_logprobs, p.prox_versions, "
    "t.spliced, t.fork_reason, t.finish_reason, t.created_at, sm.json, t.drift, t.api, t.response_id "
    "FROM turns t LEFT JOIN proximal p ON p.turn_seq = t.seq JOIN samplings sm ON sm.id = t.sampling_id "
)
_SESSION_COLS = "session_id, group_id, group_size, reward, closed, created_at, metadata, rewarded_at, lease_id, acked"

_MAX_CONV_DEPTH = 16  # a stored conversation is rebuilt from at most this many deltas
_MIN_SHARED_BYTES = 64


class _LRU:
    """Decoded token sequences / conversations by key, bounded by total size."""

    def __init__(self, budget: int):
        self.budget, self.used, self.items = budget, 0, OrderedDict()

    def get(self, key):
        value = self.items.get(key)
        if value is not None:
            self.items.move_to_end(key)
        return value

    def put(self, key, value) -> None:
        size = len(value)
        if size > self.budget or key in self.items:
            return
        self.items[key] = value
        self.used += size
        while self.used > self.budget:
            _, old = self.items.popitem(last=False)
            self.used -= len(old)


class Store:
    """Sessions, turns, responses and leases in one SQLite file (see the module docstring)."""

    def __init__(
        self,
        path: str,
        *,
        synchronous: str = "NORMAL",
        page_size: int = 1024,
        clock: Callable[[], float] = time.time,
    ):
        if synchronous.upper() not in ("NORMAL", "FULL", "EXTRA"):
            raise ValueError("synchronous must be NORMAL, FULL or EXTRA (OFF would lose committed turns)")
        self.path = path
        self._clock = clock
        if path != ":memory:" and os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        self._lock = threading.RLock()
        self._conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=10.0)
        c = self._conn
        # Small pages: turn rows are a few KB and SQLite wastes on average half a cell per page;
        # 1 KiB pages measured ~1 byte/token smaller than 4 KiB. Only applies to a new file.
        c.execute(f"PRAGMA page_size={int(page_size)}")
        c.execute("PRAGMA journal_mode=WAL")
        c.execute(f"PRAGMA synchronous={synchronous.upper()}")
        c.execute("PRAGMA journal_size_limit=67108864")  # keep the WAL file from growing without bound
        c.execute("PRAGMA foreign_keys=OFF")
        version = c.execute("PRAGMA user_version").fetchone()[0]
        if version not in (0, SCHEMA_VERSION):
            raise StoreError(f"{path}: store schema version {version}, this Splice reads {SCHEMA_VERSION}")
        with self._lock:  # idempotent DDL (IF NOT EXISTS): a crash half-way is repaired on the next open
            c.executescript(_SCHEMA + pool_ledger.SCHEMA)
            c.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        # Lookups on the request path use their own connection: in WAL mode they read the last
        # committed state without waiting for the writer's lock.
        self._checkpointer: threading.Thread | None = None
        self._closing = threading.Event()
        if path == ":memory:":
            self._rconn, self._rlock = self._conn, self._lock
        else:
            self._rconn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=10.0)
            self._rlock = threading.Lock()
            # Checkpoint the WAL from a background thread (PASSIVE: never blocks writers), so a
            # commit on the request path never pays for copying pages into the database file.
            c.execute("PRAGMA wal_autocheckpoint=0")
            self._checkpointer = threading.Thread(
                target=self._checkpoint_loop, args=(path,), name="splice-wal-checkpoint", daemon=True
            )
            self._checkpointer.start()
        self._full_ids = _LRU(4_000_000)  # turn seq -> prompt+output ids (int32 array)
        self._convs = _LRU(64 << 20)  # response seq -> conversation bytes

    # ------------------------------------------------------------ plumbing

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self._conn
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def _checkpoint_loop(self, path: str, interval_s: float = 1.0) -> None:
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=10.0)
        try:
            while not self._closing.wait(interval_s):
                try:
                    conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
                except sqlite3.Error:
                    pass  # busy or closing: the next round catches up
        finally:
            conn.close()

    def close(self) -> None:
        self._closing.set()
        if self._checkpointer is not None:
            self._checkpointer.join(timeout=5)
        with self._lock:
            self._conn.close()
        if self._rconn is not self._conn:
            with self._rlock:
                self._rconn.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ sessions

    @staticmethod
    def _session(row) -> SessionRecord:
        sid, gid, gsize, reward, closed, created, meta, rewarded_at, lease_id, acked = row
        return SessionRecord(
            session_id=sid,
            group_id=gid,
            group_size=gsize,
            reward=reward,
            closed=bool(closed),
            created_at=created,
            metadata=orjson.loads(meta) if meta else {},
            rewarded_at=rewarded_at,
            lease_id=lease_id,
            acked=bool(acked),
        )

    def _get_session(self, conn, session_id: str) -> SessionRecord | None:
        row = conn.execute(f"SELECT {_SESSION_COLS} FROM sessions WHERE session_id = ?", (session_id,)).fetchone()
        return None if row is None else self._session(row)

    def upsert_session(
        self,
        session_id: str,
        *,
        group_id: str | None = None,
        group_size: int | None = None,
        metadata: dict | None = None,
    ) -> SessionRecord:
        """Create the session or fill in what it lacked; metadata keys are merged (new values win).

        A session's group cannot change once set: a different ``group_id`` / ``group_size`` is a Conflict.
        """
        if group_size is not None and (not isinstance(group_size, int) or group_size < 1):
            raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
        with self._tx() as c:
            cur = self._get_session(c, session_id)
            if cur is None:
                c.execute(
                    "INSERT INTO sessions (session_id, group_id, group_size, created_at, metadata) VALUES (?, ?, ?, ?, ?)",
                    (session_id, group_id, group_size, self._clock(), orjson.dumps(metadata or {})),
                )
            else:
                if group_id is not None and cur.group_id not in (None, group_id):
                    raise Conflict(f"session {session_id} belongs to group {cur.group_id!r}, not {group_id!r}")
                if group_size is not None and cur.group_size not in (None, group_size):
                    raise Conflict(f"session {session_id} has group size {cur.group_size}, not {group_size}")
                merged = {**cur.metadata, **(metadata or {})}
                c.execute(
                    "UPDATE sessions SET group_id = COALESCE(group_id, ?), group_size = COALESCE(group_size, ?), "
                    "metadata = ? WHERE session_id = ?",
                    (group_id, group_size, orjson.dumps(merged), session_id),
                )
            return self._get_session(c, session_id)

    def get_session(self, session_id: str) -> SessionRecord | None:
        with self._rlock:
            return self._get_session(self._rconn, session_id)

    def set_reward(self, session_id: str, reward: float) -> SessionRecord:
        """Record the reward and close the session; its samples become ready for the trainer."""
        reward = float(reward)
        if not math.isfinite(reward):
            raise ValueError(f"reward must be a finite number, got {reward!r}")
        with self._tx() as c:
            cur = self._get_session(c, session_id)
            if cur is None:
                raise NotFound(f"no session {session_id!r}")
            if cur.closed:
                raise Conflict(f"session {session_id!r} already has a reward ({cur.reward}); rewards are final")
            c.execute(
                "UPDATE sessions SET reward = ?, closed = 1, rewarded_at = ? WHERE session_id = ?",
                (reward, self._clock(), session_id),
            )
            return self._get_session(c, session_id)

    # ------------------------------------------------------------ turns

    def add_turn(self, turn: TurnRecord, *, fingerprints: Sequence[str] = ()) -> None:
        """Commit a finished turn (durable when this returns) and register its response id.

        ``fingerprints`` (history hashes that lead to this turn, see ``put_fingerprint``) are
        written in the same transaction: one commit per turn on the hot path.
        """
        turn.check()
        out = np.asarray(turn.output_ids, dtype=np.int64)
        prompt = np.asarray(turn.prompt_ids, dtype=np.int64)
        if not (_fits_i32(out) and _fits_i32(prompt) and _fits_i32(turn.versions) and _fits_i32(turn.proximal_versions)):
            raise ValueError(f"turn {turn.turn_id}: ids and versions must fit in int32")
        prompt = prompt.astype(_I32)
        logprobs = np.asarray(turn.output_logprobs, dtype=_F32)
        versions = np.asarray(turn.versions, dtype=_I32)
        prox = np.asarray(turn.proximal_logprobs_t, dtype=_F32)
        prox_versions = np.asarray(turn.proximal_versions, dtype=_I32)
        sampling = orjson.dumps(turn.requested_sampling or {}, option=orjson.OPT_SORT_KEYS)
        committed = False
        with self._tx() as c:
            session = self._get_session(c, turn.session_id)
            if session is None:
                raise NotFound(f"no session {turn.session_id!r} for turn {turn.turn_id}")
            if session.closed:
                raise Conflict(f"session {turn.session_id!r} is closed (reward set); it takes no more turns")
            if c.execute("SELECT 1 FROM turns WHERE turn_id = ?", (turn.turn_id,)).fetchone():
                raise Conflict(f"turn {turn.turn_id!r} already stored")
            if c.execute("SELECT 1 FROM turns WHERE session_id = ? AND idx = ?", (turn.session_id, turn.index)).fetchone():
                raise Conflict(f"session {turn.session_id!r} already has a turn with index {turn.index}")
            if c.execute("SELECT 1 FROM item_ids WHERE item_id = ?", (turn.response_id,)).fetchone():
                raise Conflict(f"id {turn.response_id!r} already names another turn")
            base_seq, base_len = self._pick_prompt_base(c, turn, prompt)
            cur = c.execute(
                "INSERT INTO turns (turn_id, session_id, idx, parent_turn_id, prompt_base, prompt_base_len, "
                "prompt_tail, n_prompt, n_output, output_ids, logprobs, versions, spliced, fork_reason, "
                "finish_reason, created_at, sampling_id, drift, api, response_id) "
                "VALUES (" + ",".join("?" * 20) + ")",
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
                    out.astype(_I32).tobytes(),
                    logprobs.tobytes(),
                    pack_runs(versions),
                    int(turn.spliced),
                    turn.fork_reason,
                    turn.finish_reason,
                    turn.created_at,
                    self._sampling_id(c, sampling),
                    int(turn.drift),
                    turn.api,
                    turn.response_id,
                ),
            )
            seq = cur.lastrowid
            self._write_proximal(c, seq, logprobs, versions, prox, prox_versions)
            c.execute("INSERT INTO item_ids (item_id, turn_seq) VALUES (?, ?)", (turn.response_id, seq))
            if fingerprints:
                c.executemany(
                    "INSERT OR REPLACE INTO fingerprints (fp, turn_seq) VALUES (?, ?)", [(fp, seq) for fp in fingerprints]
                )
            committed = True
        if committed:  # only after COMMIT: a rolled-back seq may be reused by another turn
            with self._lock:
                self._full_ids.put(seq, np.concatenate([prompt, out.astype(_I32)]))

    @staticmethod
    def _sampling_id(c, blob: bytes) -> int:
        row = c.execute("SELECT id FROM samplings WHERE json = ?", (blob,)).fetchone()
        return row[0] if row else c.execute("INSERT INTO samplings (json) VALUES (?)", (blob,)).lastrowid

    @staticmethod
    def _write_proximal(c, seq: int, logprobs, versions, prox, prox_versions) -> None:
        """Store what differs from the behaviour arrays, and which versions still lack a value."""
        prox_blob, pv_blob = pack_proximal(logprobs, versions, prox, prox_versions)
        if prox_blob is None and pv_blob is None:
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
        else:
            c.execute("DELETE FROM pending WHERE turn_seq = ?", (seq,))

    def _pick_prompt_base(self, c, turn: TurnRecord, prompt: np.ndarray) -> tuple[int | None, int]:
        """The earlier turn of the session whose prompt+output shares the longest prefix with this prompt."""
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
        return self._decode_prompts(rows)[seq][1]

    def _decode_prompts(self, rows) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """seq -> (prompt, prompt+output) for rows of one session given in seq order."""
        out: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for seq, base, base_len, tail, output_ids in rows:
            if base is None:
                head = np.empty(0, dtype=_I32)
            else:
                full = out[base][1] if base in out else self._full_ids.get(base)
                if full is None:  # a base outside the rows given: cannot happen for whole-session loads
                    full = self._full_sequence(self._conn, base)
                head = full[:base_len]
            prompt = np.concatenate([head, unpack_i32(tail)])
            full_seq = np.concatenate([prompt, unpack_i32(output_ids)])
            out[seq] = (prompt, full_seq)
            self._full_ids.put(seq, full_seq)
        return out

    def _turn(self, row, prompt: np.ndarray) -> TurnRecord:
        (
            _seq, turn_id, session_id, idx, parent, _base, _base_len, _tail, _n_out,
            output_ids, logprobs, versions, prox_lp, prox_v, spliced, fork_reason, finish_reason,
            created_at, sampling, drift, api, response_id,
        ) = row  # fmt: skip
        lp = unpack_f32(logprobs)
        v = unpack_runs(versions)
        plp, pv = unpack_proximal(lp, v, prox_lp, prox_v)
        return TurnRecord(
            turn_id=turn_id,
            session_id=session_id,
            index=idx,
            parent_turn_id=parent,
            prompt_ids=prompt.tolist(),
            output_ids=unpack_i32(output_ids).tolist(),
            output_logprobs=lp.tolist(),
            versions=v.tolist(),
            proximal_logprobs_t=plp.tolist(),
            proximal_versions=pv.tolist(),
            spliced=bool(spliced),
            fork_reason=fork_reason,
            finish_reason=finish_reason,
            created_at=created_at,
            requested_sampling=orjson.loads(sampling),
            drift=bool(drift),
            api=api,
            response_id=response_id,
        )

    def _turns_from_rows(self, c, rows) -> list[TurnRecord]:
        """Decode full turn rows (any sessions), rebuilding prompts from their bases."""
        result = []
        for row in rows:
            seq, base, base_len, tail = row[0], row[5], row[6], row[7]
            head = np.empty(0, dtype=_I32) if base is None else self._full_sequence(c, base)[:base_len]
            prompt = np.concatenate([head, unpack_i32(tail)])
            self._full_ids.put(seq, np.concatenate([prompt, unpack_i32(row[9])]))
            result.append(self._turn(row, prompt))
        return result

    def list_turns(self, session_id: str) -> list[TurnRecord]:
        """Every turn of the session in index order (empty for an unknown session)."""
        with self._lock:
            return self._list_turns(self._conn, session_id)

    def _list_turns(self, c, session_id: str) -> list[TurnRecord]:
        rows = c.execute(_TURN_SELECT + "WHERE t.session_id = ? ORDER BY t.seq", (session_id,)).fetchall()
        prompts = self._decode_prompts([(r[0], r[5], r[6], r[7], r[9]) for r in rows])
        turns = [self._turn(r, prompts[r[0]][0]) for r in rows]
        return sorted(turns, key=lambda t: t.index)

    def next_turn_index(self, session_id: str) -> int:
        """The index the session's next turn takes (one indexed lookup, whatever the session's length)."""
        with self._lock:
            row = self._conn.execute("SELECT MAX(idx) FROM turns WHERE session_id = ?", (session_id,)).fetchone()
            return 0 if row is None or row[0] is None else int(row[0]) + 1

    def list_turn_ids(self, session_id: str) -> list[str]:
        """The session's turn ids in index order, without decoding any tokens."""
        with self._lock:
            rows = self._conn.execute("SELECT turn_id FROM turns WHERE session_id = ? ORDER BY idx", (session_id,))
            return [r[0] for r in rows]

    def set_drift(self, turn_id: str, drift: bool = True) -> None:
        """Record, after the fact, whether a full re-render would have produced different ids."""
        with self._tx() as c:
            if c.execute("UPDATE turns SET drift = ? WHERE turn_id = ?", (int(drift), turn_id)).rowcount == 0:
                raise NotFound(f"no turn {turn_id!r}")

    def get_turn(self, turn_id: str) -> TurnRecord | None:
        with self._lock:
            row = self._conn.execute(_TURN_SELECT + "WHERE t.turn_id = ?", (turn_id,)).fetchone()
            return None if row is None else self._turns_from_rows(self._conn, [row])[0]

    def update_proximal(self, turn_id: str, proximal_logprobs_t: list[float], proximal_versions: list[int]) -> None:
        """Replace a turn's proximal arrays (output coordinates) after a recompute; commits."""
        prox = np.asarray(proximal_logprobs_t, dtype=_F32)
        if not np.all(np.isfinite(prox)):
            raise ValueError(f"turn {turn_id}: proximal logprobs must be finite")
        if not _fits_i32(proximal_versions):
            raise ValueError(f"turn {turn_id}: proximal versions must fit in int32")
        prox_versions = np.asarray(proximal_versions, dtype=_I32)
        with self._tx() as c:
            row = c.execute("SELECT seq, n_output, logprobs, versions FROM turns WHERE turn_id = ?", (turn_id,)).fetchone()
            if row is None:
                raise NotFound(f"no turn {turn_id!r}")
            seq, n, lp_blob, v_blob = row
            if prox.size != n or prox_versions.size != n:
                raise ValueError(f"turn {turn_id}: expected {n} proximal values, got {prox.size} / {prox_versions.size}")
            self._write_proximal(c, seq, unpack_f32(lp_blob), unpack_runs(v_blob), prox, prox_versions)

    def owed_recompute(self, version: int) -> list[TurnRecord]:
        """Turns of not-yet-acked sessions holding tokens of ``version - 1`` with no proximal value yet (R2)."""
        with self._lock:
            return self._turns_from_rows(self._conn, self._owed_rows(version))

    def owed_turn_count(self, version: int) -> int:
        """``len(owed_recompute(version))`` without decoding prompts (for status pages)."""
        with self._lock:
            return len(self._owed_rows(version))

    def _owed_rows(self, version: int) -> list:
        owed = version - 1
        rows = self._conn.execute(
            _TURN_SELECT + "JOIN pending q ON q.turn_seq = t.seq JOIN sessions s ON s.session_id = t.session_id "
            "WHERE q.vmax >= ? AND q.vmin <= ? AND s.acked = 0 ORDER BY t.seq",
            (owed, owed),
        ).fetchall()
        result = []
        for r in rows:  # the columns only bound the versions; check token by token
            versions = unpack_runs(r[11])
            pv = versions if r[13] is None else unpack_runs(r[13])
            if np.any((versions == owed) & (pv == versions)):
                result.append(r)
        return result

    # ------------------------------------------------------------ ids, fingerprints, responses

    def _turn_seq(self, c, turn_id: str) -> int:
        row = c.execute("SELECT seq FROM turns WHERE turn_id = ?", (turn_id,)).fetchone()
        if row is None:
            raise NotFound(f"no turn {turn_id!r}")
        return row[0]

    def _turn_by_seq(self, seq: int) -> TurnRecord:
        row = self._conn.execute(_TURN_SELECT + "WHERE t.seq = ?", (seq,)).fetchone()
        return self._turns_from_rows(self._conn, [row])[0]

    def add_item_ids(self, turn_id: str, ids: list[str]) -> None:
        """Register ids the proxy issued for a turn's output (msg_, rs_, fc_, call_, ...)."""
        with self._tx() as c:
            seq = self._turn_seq(c, turn_id)
            for item_id in ids:
                row = c.execute("SELECT turn_seq FROM item_ids WHERE item_id = ?", (item_id,)).fetchone()
                if row is None:
                    c.execute("INSERT INTO item_ids (item_id, turn_seq) VALUES (?, ?)", (item_id, seq))
                elif row[0] != seq:
                    other = c.execute("SELECT turn_id FROM turns WHERE seq = ?", (row[0],)).fetchone()[0]
                    raise Conflict(f"id {item_id!r} already names turn {other!r}")

    def find_turn_by_item_id(self, item_id: str) -> TurnRecord | None:
        with self._lock:
            row = self._conn.execute("SELECT turn_seq FROM item_ids WHERE item_id = ?", (item_id,)).fetchone()
            return None if row is None else self._turn_by_seq(row[0])

    def put_fingerprint(self, fp: str, turn_id: str) -> None:
        """Map a message-history hash to the turn it led to; a later turn with the same hash replaces it."""
        with self._tx() as c:
            seq = self._turn_seq(c, turn_id)
            c.execute("INSERT OR REPLACE INTO fingerprints (fp, turn_seq) VALUES (?, ?)", (fp, seq))

    def lookup_fingerprint(self, fp: str | bytes) -> tuple[str, str] | None:
        """``(turn_id, session_id)`` for a history hash: the cheap lookup the hot path needs."""
        with self._rlock:
            return self._rconn.execute(
                "SELECT t.turn_id, t.session_id FROM fingerprints f JOIN turns t ON t.seq = f.turn_seq WHERE f.fp = ?",
                (fp,),
            ).fetchone()

    def find_turn_by_fingerprint(self, fp: str) -> TurnRecord | None:
        with self._lock:
            row = self._conn.execute("SELECT turn_seq FROM fingerprints WHERE fp = ?", (fp,)).fetchone()
            return None if row is None else self._turn_by_seq(row[0])

    def put_response(self, response_id: str, session_id: str, turn_id: str | None, body: bytes, conversation: bytes) -> None:
        """Store a response (for ``GET /v1/responses/{id}``) and the conversation ``previous_response_id`` expands to.

        The conversation is stored as a delta against the session's latest stored response,
        since each turn's conversation usually extends the previous one.
        """
        conv = bytes(conversation)
        with self._tx() as c:
            if c.execute("SELECT 1 FROM responses WHERE response_id = ?", (response_id,)).fetchone():
                raise Conflict(f"response {response_id!r} already stored")
            base = c.execute(
                "SELECT seq, conv_depth FROM responses WHERE session_id = ? ORDER BY seq DESC LIMIT 1", (session_id,)
            ).fetchone()
            base_seq, base_len, depth = None, 0, 0
            if base is not None and base[1] + 1 < _MAX_CONV_DEPTH:
                shared = _common_bytes(self._conversation(c, base[0]), conv)
                if shared >= _MIN_SHARED_BYTES:
                    base_seq, base_len, depth = base[0], shared, base[1] + 1
            cur = c.execute(
                "INSERT INTO responses (response_id, session_id, turn_id, created_at, body, conv_base, conv_base_len, "
                "conv_tail, conv_depth) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    response_id,
                    session_id,
                    turn_id,
                    self._clock(),
                    zlib.compress(bytes(body), 6),
                    base_seq,
                    base_len,
                    zlib.compress(conv[base_len:], 6),
                    depth,
                ),
            )
            seq = cur.lastrowid
        with self._lock:
            self._convs.put(seq, conv)

    def _conversation(self, c, seq: int) -> bytes:
        hit = self._convs.get(seq)
        if hit is not None:
            return hit
        base, base_len, tail = c.execute(
            "SELECT conv_base, conv_base_len, conv_tail FROM responses WHERE seq = ?", (seq,)
        ).fetchone()
        head = b"" if base is None else self._conversation(c, base)[:base_len]
        conv = head + zlib.decompress(tail)
        self._convs.put(seq, conv)
        return conv

    def get_response(self, response_id: str) -> tuple[bytes, bytes] | None:
        """(body, conversation) as given to ``put_response``, or None."""
        with self._lock:
            row = self._conn.execute("SELECT seq, body FROM responses WHERE response_id = ?", (response_id,)).fetchone()
            if row is None:
                return None
            return zlib.decompress(row[1]), self._conversation(self._conn, row[0])

    # ------------------------------------------------------------ training pool

    def pull(self, max_samples: int, lease_timeout_s: float) -> tuple[str | None, list[dict]]:
        """Lease ready samples: whole sessions, whole groups, oldest-ready first.

        Returns ``(None, [])`` when nothing is ready (no lease is created). A unit (session or
        complete group) that does not fit in what is left of ``max_samples`` waits for the next
        pull, unless it is the first of the lease, so an oversized group is never stuck.
        Rewarded sessions without any turn have nothing to train on and are acked on the spot.
        """
        if lease_timeout_s <= 0:
            raise ValueError("lease_timeout_s must be positive")
        if max_samples <= 0:
            return None, []
        with self._tx() as c:
            now = self._clock()
            pool_ledger.expire_leases(c, now)
            taken: list[str] = []
            empty: list[str] = []
            samples: list[dict] = []
            for unit in pool_ledger.ready_units(c):
                if len(samples) >= max_samples:
                    break
                unit_samples = []
                for session_id in unit.session_ids:
                    session = self._get_session(c, session_id)
                    turns = self._list_turns(c, session_id)
                    unit_samples.extend(s.to_dict() for s in assemble_samples(session, turns))
                if unit_samples and samples and len(samples) + len(unit_samples) > max_samples:
                    continue
                (taken if unit_samples else empty).extend(unit.session_ids)
                samples.extend(unit_samples)
            pool_ledger.mark_acked(c, empty)
            if not samples:
                return None, []
            lease_id = "lease_" + uuid.uuid4().hex
            pool_ledger.create_lease(c, lease_id, taken, len(samples), now, lease_timeout_s)
            return lease_id, samples

    def ack(self, lease_id: str) -> None:
        """The trainer consumed the lease's samples: its sessions are never handed out again.

        Acking an acked lease again is a no-op (a retried request). Unknown lease: NotFound.
        A lease past its timeout: Conflict (its samples went back to the pool and may be
        handed out again).
        """
        with self._tx() as c:
            now = self._clock()
            outcome = pool_ledger.ack_lease(c, lease_id, now)
            expires_at = pool_ledger.lease_expiry(c, lease_id)
        if outcome == "unknown":
            raise NotFound(f"no lease {lease_id!r}")
        if outcome == "expired":
            raise Conflict(
                f"lease {lease_id!r} expired at {expires_at:.3f} (now {now:.3f}) before it was acked; "
                "its samples went back to the pool"
            )

    def stats(self) -> dict:
        """Counts for /metrics and /admin/status."""
        with self._lock:
            c = self._conn
            now = self._clock()
            sessions, open_, rewarded, pending, acked = c.execute(
                "SELECT COUNT(*), COALESCE(SUM(closed = 0), 0), COALESCE(SUM(reward IS NOT NULL), 0), "
                "COALESCE(SUM(reward IS NOT NULL AND acked = 0 AND lease_id IS NULL), 0), COALESCE(SUM(acked), 0) "
                "FROM sessions"
            ).fetchone()
            turns, out_tokens, prompt_tokens, spliced = c.execute(
                "SELECT COUNT(*), COALESCE(SUM(n_output), 0), COALESCE(SUM(n_prompt), 0), COALESCE(SUM(spliced), 0) FROM turns"
            ).fetchone()
            leases, leased = pool_ledger.count_active(c, now)
            page_size = c.execute("PRAGMA page_size").fetchone()[0]
            pages = c.execute("PRAGMA page_count").fetchone()[0]
            free = c.execute("PRAGMA freelist_count").fetchone()[0]
        return {
            "sessions": sessions,
            "sessions_open": open_,
            "sessions_rewarded": rewarded,
            "rewards_pending": pending,  # rewarded, not leased, not acked (incl. groups still incomplete)
            "sessions_leased": leased,
            "leases_active": leases,
            "sessions_acked": acked,
            "turns": turns,
            "turns_spliced": spliced,
            "tokens": out_tokens,  # generated tokens
            "prompt_tokens": prompt_tokens,
            "db_bytes": (pages - free) * page_size,
            "file_bytes": _file_size(self.path) + _file_size(self.path + "-wal"),
        }


def _common_bytes(a: bytes, b: bytes) -> int:
    return common_prefix_len(np.frombuffer(a, dtype=np.uint8), np.frombuffer(b, dtype=np.uint8))


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0
