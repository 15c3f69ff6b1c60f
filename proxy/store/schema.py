"""The store's tables, and how an older file is brought up to date."""

from __future__ import annotations

import sqlite3

from .errors import StoreError

SCHEMA_VERSION = 6

SCHEMA = """
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
CREATE INDEX IF NOT EXISTS sessions_created ON sessions(created_at);   -- GET /v1/sessions
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
    role            TEXT NOT NULL DEFAULT 'main',  -- main | auxiliary | subagent | compacted (docs/samples.md)
    UNIQUE (session_id, idx)
);
CREATE INDEX IF NOT EXISTS turns_parent ON turns(parent_turn_id) WHERE parent_turn_id IS NOT NULL;
-- forks only (few rows): the viewer's fork filter and counts never read the wide token rows
CREATE INDEX IF NOT EXISTS turns_fork ON turns(fork_reason, session_id) WHERE fork_reason IS NOT NULL;
-- turns of a role other than `main` (side calls, sub-agents, compactions): the viewer's role
-- filter and role column read this, never the wide token rows
CREATE INDEX IF NOT EXISTS turns_role ON turns(session_id, role) WHERE role != 'main';

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
CREATE TABLE IF NOT EXISTS abandoned (   -- turns committed but never delivered (client went away)
    turn_seq INTEGER PRIMARY KEY
);
CREATE TABLE IF NOT EXISTS samplings (
    id   INTEGER PRIMARY KEY,
    json BLOB NOT NULL UNIQUE
);

CREATE TABLE IF NOT EXISTS item_ids (
    item_id  TEXT PRIMARY KEY,
    turn_seq INTEGER NOT NULL
) WITHOUT ROWID;

-- History fingerprints -> the turns whose answer they end with. Several turns may share one
-- (sessions of a group that sampled the same answer): the planner chooses among them. A turn
-- has one row per scope (unscoped, its session); `variant` says which tools and template
-- kwargs it was asked with (proxy.session.turn.TurnRequest.fingerprint_variant). Rows stored before schema 6 have
-- none: those turns have a row per key instead (exact, same tools, history only).
CREATE TABLE IF NOT EXISTS fingerprints (
    fp       BLOB NOT NULL,
    turn_seq INTEGER NOT NULL,
    variant  BLOB,
    PRIMARY KEY (fp, turn_seq)
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

CREATE TABLE IF NOT EXISTS leases (
    lease_id    TEXT PRIMARY KEY,
    created_at  REAL NOT NULL,
    expires_at  REAL NOT NULL,
    state       TEXT NOT NULL,          -- active | acked | expired
    n_samples   INTEGER NOT NULL,
    session_ids BLOB NOT NULL           -- orjson list, kept for auditing after the lease ends
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS leases_active ON leases(expires_at) WHERE state = 'active';

-- Images, once per content hash (sha256 over the decoded pixels); a turn records where each
-- image of its prompt sits (orjson [[hash, offset, length, grid_t, grid_h, grid_w], ...]).
CREATE TABLE IF NOT EXISTS images (
    hash       TEXT PRIMARY KEY,
    mime       TEXT NOT NULL,
    width      INTEGER NOT NULL,
    height     INTEGER NOT NULL,
    grid_t     INTEGER NOT NULL,
    grid_h     INTEGER NOT NULL,
    grid_w     INTEGER NOT NULL,
    nbytes     INTEGER NOT NULL,
    data       BLOB NOT NULL,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS turn_images (
    turn_seq INTEGER PRIMARY KEY,
    refs     BLOB NOT NULL
);
"""


def _v2_to_v3(c: sqlite3.Connection) -> None:
    """Fingerprints may name several turns (was: the latest only)."""
    c.execute("ALTER TABLE fingerprints RENAME TO fingerprints_v2")
    # the new table only: later parts of the schema (the role index) need later migrations first
    for stmt in _statements(SCHEMA):
        if "TABLE IF NOT EXISTS fingerprints" in stmt:
            c.execute(stmt)
    c.execute("INSERT OR IGNORE INTO fingerprints (fp, turn_seq) SELECT fp, turn_seq FROM fingerprints_v2")
    c.execute("DROP TABLE fingerprints_v2")


def _v3_to_v4(c: sqlite3.Connection) -> None:
    """Image tables (created by the schema script); no existing row changes."""


def _v4_to_v5(c: sqlite3.Connection) -> None:
    """Episode roles: every turn recorded before roles existed was the agent's own (``main``)."""
    c.execute("ALTER TABLE turns ADD COLUMN role TEXT NOT NULL DEFAULT 'main'")


def _v5_to_v6(c: sqlite3.Connection) -> None:
    """Fingerprint rows keep the tools and kwargs they were asked with: a turn is stored under
    two rows instead of six. Earlier rows stay as they are (no variant) and are still found."""
    if "variant" not in [r[1] for r in c.execute("PRAGMA table_info(fingerprints)")]:  # v2 -> v3 made it anew
        c.execute("ALTER TABLE fingerprints ADD COLUMN variant BLOB")


_MIGRATIONS = {2: _v2_to_v3, 3: _v3_to_v4, 4: _v4_to_v5, 5: _v5_to_v6}


class SchemaError(StoreError):
    """The file was written by a newer Splice, or is not a Splice store."""


def apply(c: sqlite3.Connection, path: str) -> None:
    """Create the tables of a new file or migrate an older one, in one transaction."""
    version = c.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise SchemaError(f"{path}: store schema version {version}, this Splice reads up to {SCHEMA_VERSION}")
    c.execute("BEGIN IMMEDIATE")
    try:
        while 0 < version < SCHEMA_VERSION:
            if version not in _MIGRATIONS:
                raise SchemaError(f"{path}: no migration from store schema version {version}")
            _MIGRATIONS[version](c)
            version += 1
        for stmt in _statements(SCHEMA):
            c.execute(stmt)
        c.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    except BaseException:
        c.execute("ROLLBACK")
        raise
    c.execute("COMMIT")


def _statements(script: str) -> list[str]:
    """Split DDL into statements (``executescript`` would commit the open transaction)."""
    out, buf = [], []
    for line in script.splitlines():
        line = line.split("--", 1)[0].rstrip()
        if not line:
            continue
        buf.append(line)
        if line.endswith(";") and sqlite3.complete_statement("\n".join(buf)):
            out.append("\n".join(buf))
            buf = []
    return out
