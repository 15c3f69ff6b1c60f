"""Which rewarded sessions the trainer may pull next, and the leases that hold them.

A *unit* is what is handed out indivisibly: one session without a declared group size, or
every available rewarded session of a group once at least ``group_size`` of them have rewards
(GRPO normalizes within a group, so a group is never split across leases). Leases live in
SQLite so a restarted proxy neither loses nor double-hands samples; expiry is checked lazily
when the trainer pulls or acks. These functions run inside the caller's transaction.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from typing import Literal

import orjson



AckOutcome = Literal["acked", "already_acked", "expired", "unknown"]


@dataclass
class Unit:
    """Sessions handed out together, oldest-ready first."""

    session_ids: list[str]
    group_id: str | None
    ready_at: float


def expire_leases(conn: sqlite3.Connection, now: float) -> int:
    """Return the sessions of timed-out leases to the pool; returns how many leases expired."""
    rows = conn.execute("SELECT lease_id FROM leases WHERE state = 'active' AND expires_at <= ?", (now,)).fetchall()
    for (lease_id,) in rows:
        _release(conn, lease_id, "expired")
    return len(rows)


def _release(conn: sqlite3.Connection, lease_id: str, state: str) -> None:
    conn.execute("UPDATE leases SET state = ? WHERE lease_id = ?", (state, lease_id))
    conn.execute("UPDATE sessions SET lease_id = NULL WHERE lease_id = ?", (lease_id,))


def ready_units(conn: sqlite3.Connection) -> list[Unit]:
    """Every unit the trainer could be given now, in the order they became ready."""
    rows = conn.execute(
        "SELECT session_id, group_id, rewarded_at FROM sessions "
        "WHERE reward IS NOT NULL AND acked = 0 AND lease_id IS NULL ORDER BY rewarded_at, session_id"
    ).fetchall()
    group_ids = sorted({g for _, g, _ in rows if g is not None})
    sizes: dict[str, int | None] = {}
    for i in range(0, len(group_ids), 500):  # stay under SQLite's bound-parameter limit
        chunk = group_ids[i : i + 500]
        marks = ",".join("?" * len(chunk))
        sizes.update(
            conn.execute(
                f"SELECT group_id, MAX(group_size) FROM sessions WHERE group_id IN ({marks}) GROUP BY group_id",
                chunk,
            ).fetchall()
        )
    units: list[Unit] = []
    groups: dict[str, Unit] = {}
    for session_id, group_id, rewarded_at in rows:
        size = sizes.get(group_id) if group_id is not None else None
        if size is None:
            units.append(Unit([session_id], group_id, rewarded_at))
            continue
        unit = groups.setdefault(group_id, Unit([], group_id, rewarded_at))
        unit.session_ids.append(session_id)
        unit.ready_at = max(unit.ready_at, rewarded_at)
    for group_id, unit in groups.items():
        if len(unit.session_ids) >= (sizes[group_id] or 0):
            units.append(unit)
    units.sort(key=lambda u: (u.ready_at, u.session_ids[0]))
    return units


def still_free(conn: sqlite3.Connection, session_ids: list[str]) -> set[str]:
    """The sessions among ``session_ids`` that are still rewarded, unleased and unacked."""
    free: set[str] = set()
    for i in range(0, len(session_ids), 500):
        chunk = session_ids[i : i + 500]
        marks = ",".join("?" * len(chunk))
        free.update(
            r[0]
            for r in conn.execute(
                f"SELECT session_id FROM sessions WHERE session_id IN ({marks}) "
                "AND reward IS NOT NULL AND acked = 0 AND lease_id IS NULL",
                chunk,
            )
        )
    return free


def create_lease(
    conn: sqlite3.Connection, lease_id: str, session_ids: list[str], n_samples: int, now: float, timeout_s: float
) -> None:
    conn.execute(
        "INSERT INTO leases (lease_id, created_at, expires_at, state, n_samples, session_ids) VALUES (?, ?, ?, 'active', ?, ?)",
        (lease_id, now, now + timeout_s, n_samples, orjson.dumps(session_ids)),
    )
    conn.executemany("UPDATE sessions SET lease_id = ? WHERE session_id = ?", [(lease_id, s) for s in session_ids])


def mark_acked(conn: sqlite3.Connection, session_ids: list[str]) -> None:
    """Sessions whose samples the trainer consumed (or that had nothing to train on)."""
    conn.executemany("UPDATE sessions SET acked = 1, lease_id = NULL WHERE session_id = ?", [(s,) for s in session_ids])


def ack_lease(conn: sqlite3.Connection, lease_id: str, now: float) -> AckOutcome:
    """Ack a lease: its sessions are acked forever. Acking twice is harmless (a retried request)."""
    row = conn.execute("SELECT state, expires_at, session_ids FROM leases WHERE lease_id = ?", (lease_id,)).fetchone()
    if row is None:
        return "unknown"
    state, expires_at, session_ids = row
    if state == "acked":
        return "already_acked"
    if state == "expired":
        return "expired"
    if expires_at <= now:
        _release(conn, lease_id, "expired")
        return "expired"
    conn.execute("UPDATE leases SET state = 'acked' WHERE lease_id = ?", (lease_id,))
    mark_acked(conn, orjson.loads(session_ids))
    return "acked"


def lease_expiry(conn: sqlite3.Connection, lease_id: str) -> float | None:
    row = conn.execute("SELECT expires_at FROM leases WHERE lease_id = ?", (lease_id,)).fetchone()
    return None if row is None else row[0]


def count_active(conn: sqlite3.Connection, now: float) -> tuple[int, int]:
    """(active leases, sessions they hold), not counting leases past their deadline."""
    leases, sessions = conn.execute(
        "SELECT COUNT(DISTINCT l.lease_id), COUNT(s.session_id) FROM leases l "
        "LEFT JOIN sessions s ON s.lease_id = l.lease_id WHERE l.state = 'active' AND l.expires_at > ?",
        (now,),
    ).fetchone()
    return leases, sessions
