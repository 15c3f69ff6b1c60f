"""Sessions: group membership, metadata, the reward that closes them."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Callable

import orjson

from .db import Database
from .errors import Conflict, NotFound
from .lru import LRU
from .records import SessionRecord

COLUMNS = "session_id, group_id, group_size, reward, closed, created_at, metadata, rewarded_at, lease_id, acked"
SUMMARY = "s.session_id, s.group_id, s.group_size, s.reward, s.closed, s.created_at, s.rewarded_at, s.lease_id, s.acked, s.rowid"


def session_from_row(row) -> SessionRecord:
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


def read_session(conn, session_id: str) -> SessionRecord | None:
    row = conn.execute(f"SELECT {COLUMNS} FROM sessions WHERE session_id = ?", (session_id,)).fetchone()
    return None if row is None else session_from_row(row)


@dataclass(frozen=True)
class SessionPage:
    """One page of ``SessionTable.list``: summaries oldest first, and the cursor of the next page."""

    sessions: list[dict]
    next_cursor: str | None


def _summary(row, turns: int) -> dict:
    sid, gid, gsize, reward, closed, created, rewarded_at, lease_id, acked, _rowid = row
    return {
        "session_id": sid,
        "group_id": gid,
        "group_size": gsize,
        "reward": reward,
        "closed": bool(closed),
        "created_at": created,
        "rewarded_at": rewarded_at,
        "leased": lease_id is not None,
        "acked": bool(acked),
        "turns": turns,
    }


def encode_cursor(created_at: float, rowid: int) -> str:
    return f"{created_at!r}:{rowid}"


def decode_cursor(cursor: str) -> tuple[float, int]:
    """``ValueError`` for anything that is not a cursor this table issued."""
    created, _, rowid = cursor.rpartition(":")
    value = (float(created), int(rowid))
    if not math.isfinite(value[0]):
        raise ValueError("not a cursor")
    return value


RECENT = 65536  # sessions whose last read ``for_turn`` keeps


class SessionTable:
    def __init__(self, db: Database, clock: Callable[[], float] = time.time):
        self.db = db
        self.clock = clock
        self._recent = LRU(RECENT, sized=False)  # ``for_turn``'s copies
        self._changes = 0  # ``forget`` calls: a read that overlapped one is not kept
        self._lock = threading.Lock()

    def get(self, session_id: str) -> SessionRecord | None:
        with self.db.read() as c:
            return read_session(c, session_id)

    def for_turn(self, session_id: str) -> SessionRecord | None:
        """``get`` for the turn path, from a copy kept since this table last read or changed the
        session: one query fewer a turn. What a turn reads of it moves one way only (``closed``
        once set stays set; a group once set stays), and the turn's transaction checks
        ``closed`` again, so a copy older than a write by another process costs a 409 after the
        generation instead of before it, never a wrong answer."""
        rec = self._recent.get(session_id)
        if rec is not None:
            return rec
        with self._lock:
            changes = self._changes
        rec = self.get(session_id)
        with self._lock:
            if rec is not None and changes == self._changes:
                self._recent.put(session_id, rec)
        return rec

    def forget(self, session_id: str) -> None:
        """Drop ``for_turn``'s copy of a session that was (or is being) changed."""
        with self._lock:
            self._changes += 1
            self._recent.pop(session_id)

    def list(
        self,
        *,
        group_id: str | None = None,
        closed: bool | None = None,
        since: float | None = None,
        cursor: str | None = None,
        limit: int = 100,
    ) -> SessionPage:
        """Sessions in creation order, filtered; one indexed query (``sessions_created``, or
        ``sessions_group`` with a group), metadata never decoded. The turn count is a
        correlated count on ``turns``' ``(session_id, idx)`` key."""
        where, args = [], []
        if group_id is not None:
            where.append("s.group_id = ?")
            args.append(group_id)
        if closed is not None:
            where.append("s.closed = ?")
            args.append(1 if closed else 0)
        if since is not None:
            where.append("s.created_at >= ?")
            args.append(float(since))
        if cursor is not None:
            created, rowid = decode_cursor(cursor)
            where.append("(s.created_at, s.rowid) > (?, ?)")
            args += [created, rowid]
        sql = (
            f"SELECT {SUMMARY}, (SELECT COUNT(*) FROM turns t WHERE t.session_id = s.session_id) FROM sessions s"
            + (" WHERE " + " AND ".join(where) if where else "")
            + " ORDER BY s.created_at, s.rowid LIMIT ?"
        )
        with self.db.read() as c:
            rows = c.execute(sql, (*args, limit + 1)).fetchall()
        more = len(rows) > limit
        rows = rows[:limit]
        out = [_summary(r[:-1], r[-1]) for r in rows]
        nxt = encode_cursor(rows[-1][5], rows[-1][9]) if more and rows else None
        return SessionPage(out, nxt)

    def upsert(
        self,
        session_id: str,
        *,
        group_id: str | None = None,
        group_size: int | None = None,
        metadata: dict | None = None,
    ) -> SessionRecord:
        """Create the session or fill in what it lacked (commits); see ``upsert_in``."""
        with self.db.write() as c:
            return self.upsert_in(c, session_id, group_id=group_id, group_size=group_size, metadata=metadata)

    def upsert_in(self, c, session_id: str, *, group_id=None, group_size=None, metadata=None) -> SessionRecord:
        """Inside the caller's write transaction: create or fill in; metadata keys merge (new values win).

        A session's group cannot change once set: a different ``group_id`` / ``group_size`` is a Conflict.
        """
        if group_size is not None and (not isinstance(group_size, int) or group_size < 1):
            raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
        cur = read_session(c, session_id)
        if cur is None:
            self.forget(session_id)
            c.execute(
                "INSERT INTO sessions (session_id, group_id, group_size, created_at, metadata) VALUES (?, ?, ?, ?, ?)",
                (session_id, group_id, group_size, self.clock(), orjson.dumps(metadata or {})),
            )
            return read_session(c, session_id)
        if group_id is not None and cur.group_id not in (None, group_id):
            raise Conflict(f"session {session_id} belongs to group {cur.group_id!r}, not {group_id!r}")
        if group_size is not None and cur.group_size not in (None, group_size):
            raise Conflict(f"session {session_id} has group size {cur.group_size}, not {group_size}")
        unchanged = group_id in (None, cur.group_id) and group_size in (None, cur.group_size) and not metadata
        if unchanged:
            return cur
        merged = {**cur.metadata, **(metadata or {})}
        self.forget(session_id)
        c.execute(
            "UPDATE sessions SET group_id = COALESCE(group_id, ?), group_size = COALESCE(group_size, ?), "
            "metadata = ? WHERE session_id = ?",
            (group_id, group_size, orjson.dumps(merged), session_id),
        )
        return read_session(c, session_id)

    def set_reward(self, session_id: str, reward: float) -> SessionRecord:
        """Record the reward and close the session; its samples become ready for the trainer."""
        reward = float(reward)
        if not math.isfinite(reward):
            raise ValueError(f"reward must be a finite number, got {reward!r}")
        with self.db.write() as c:
            cur = read_session(c, session_id)
            if cur is None:
                raise NotFound(f"no session {session_id!r}")
            if cur.closed:
                raise Conflict(f"session {session_id!r} already has a reward ({cur.reward}); rewards are final")
            self.forget(session_id)
            c.execute(
                "UPDATE sessions SET reward = ?, closed = 1, rewarded_at = ? WHERE session_id = ?",
                (reward, self.clock(), session_id),
            )
            rec = read_session(c, session_id)
        self.forget(session_id)  # again after the commit: a read between the two saw the session open
        return rec
