"""History fingerprints: the rows a committed turn is found by, and the lookup of a header-less
request's previous turn.

A turn has one row per scope (unscoped, and scoped to its session) keyed by its history's
digest, with a ``variant`` (the tools and template kwargs it was asked with) beside it, so one
lookup says whether a recorded turn matches a request exactly, with other kwargs, or with other
tools (``proxy.session.planner``). Rows stored before schema 6 have no variant; those turns
have a row per key instead, which the planner looks up when it meets one.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass

_SELECT = (
    "SELECT t.turn_id, t.session_id, EXISTS (SELECT 1 FROM turns k WHERE k.parent_turn_id = t.turn_id), f.variant "
    "FROM fingerprints f JOIN turns t ON t.seq = f.turn_seq WHERE f.fp = ?1 "
)


@dataclass(frozen=True)
class Candidate:
    """A recorded turn whose answer a request's history ends with."""

    turn_id: str
    session_id: str
    continued: bool  # some later turn already continues it
    variant: bytes | None = None  # what its fingerprint row keeps beside it (proxy.session.turn.TurnRequest.fingerprint_variant)


def insert_fingerprints(c: sqlite3.Connection, seq: int, fingerprints: Sequence[bytes | tuple[bytes, bytes | None]]) -> None:
    """The rows of turn ``seq``: (fingerprint, variant) pairs, or bare fingerprints (no variant)."""
    c.executemany(
        "INSERT OR IGNORE INTO fingerprints (fp, turn_seq, variant) VALUES (?, ?, ?)",
        [(fp, seq, None) if isinstance(fp, bytes) else (fp[0], seq, fp[1]) for fp in fingerprints],
    )


def find_candidates(c: sqlite3.Connection, fingerprint: bytes, variant: bytes | None, limit: int) -> list[Candidate]:
    """Turns stored under ``fingerprint``, most recent first; given a ``variant``, those stored
    with it first, then those whose variant shares its first 8 bytes (the same tools), so
    ``limit`` never cuts the better matches."""
    if variant is None:
        rows = c.execute(_SELECT + "ORDER BY f.turn_seq DESC LIMIT ?2", (fingerprint, limit)).fetchall()
    else:
        rows = c.execute(
            _SELECT + "ORDER BY f.variant IS ?3 DESC, substr(f.variant, 1, 8) IS substr(?3, 1, 8) DESC, f.turn_seq DESC LIMIT ?2",
            (fingerprint, limit, variant),
        ).fetchall()
    return [Candidate(tid, sid, bool(cont), v) for tid, sid, cont, v in rows]
