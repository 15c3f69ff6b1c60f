"""Read-only queries behind the sessions table: filters, columns, keyset paging.

One indexed walk of ``sessions`` newest first (``sessions_created``), the filters as
``EXISTS`` probes on the turns of each candidate session (``turns``' ``(session_id, idx)``
key, or the small ``turns_role`` index of the turns whose role is not ``main``), and the
columns computed only for the rows of the page. Version ranges and staleness
come from the run-length version blobs, decoded by two SQL functions registered on the
reading connection (a few runs per turn). Nothing here writes.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..session.roles import ROLES
from ..store.packing import unpack_runs
from ..store.sessions import decode_cursor, encode_cursor  # the cursor /v1/sessions issues

MAX_LIMIT = 200


def _vmin(blob: bytes | None) -> int | None:
    v = unpack_runs(blob)
    return int(v.min()) if v.size else None


def _vmax(blob: bytes | None) -> int | None:
    v = unpack_runs(blob)
    return int(v.max()) if v.size else None


def register_functions(conn) -> None:
    """``ui_vmin(versions)`` / ``ui_vmax(versions)`` on this connection (idempotent)."""
    conn.create_function("ui_vmin", 1, _vmin, deterministic=True)
    conn.create_function("ui_vmax", 1, _vmax, deterministic=True)


@dataclass(frozen=True)
class SessionFilter:
    """What the sessions table may be narrowed by; ``None`` is "any"."""

    group_id: str | None = None
    role: str | None = None  # sessions holding a turn of this episode role (proxy.session.roles)
    rewarded: bool | None = None
    fork_reason: str | None = None  # "*": any fork at all
    has_images: bool | None = None
    engine: str | None = None  # an engine replica's URL as recorded per turn (substring)
    version_min: int | None = None  # sessions holding a sampled token in [version_min, version_max]
    version_max: int | None = None
    search: str | None = None  # session id prefix


SCAN = 1000  # sessions one page may look through for the filters that read turn rows


def _where(f: SessionFilter) -> tuple[list[str], list]:
    """Filters answered by indexes or small tables: any number of sessions per page."""
    where: list[str] = []
    args: list = []
    if f.group_id is not None:
        where.append("s.group_id = ?")
        args.append(f.group_id)
    if f.search:
        where.append("s.session_id >= ? AND s.session_id < ?")
        args += [f.search, f.search + "\U0010ffff"]
    if f.role == "main":  # a turn not counted by turns_role: compare two index counts
        where.append(f"{_N_TURNS} > {_N_OTHER}")
    elif f.role is not None:  # a probe of turns_role per candidate, walking sessions_created in order
        where.append("EXISTS (SELECT 1 FROM turns t WHERE t.session_id = s.session_id AND t.role = ? AND t.role != 'main')")
        args.append(f.role)
    if f.rewarded is not None:
        where.append("s.reward IS NOT NULL" if f.rewarded else "s.reward IS NULL")
    if f.fork_reason == "*":  # turns_fork: forks only
        where.append("+s.session_id IN (SELECT session_id FROM turns WHERE fork_reason IS NOT NULL)")
    elif f.fork_reason:
        where.append("+s.session_id IN (SELECT session_id FROM turns WHERE fork_reason = ?)")
        args.append(f.fork_reason)
    if f.has_images is not None:  # turn_images: image turns only
        probe = "+s.session_id IN (SELECT t.session_id FROM turn_images ti CROSS JOIN turns t ON t.seq = ti.turn_seq)"
        where.append(probe if f.has_images else "NOT " + probe)
    return where, args


def _scanned(f: SessionFilter) -> tuple[list[str], list]:
    """Filters that read each candidate's turn rows (engine, versions): bounded by ``SCAN``."""
    where: list[str] = []
    args: list = []
    if f.engine:
        where.append(
            "EXISTS (SELECT 1 FROM turns t WHERE t.session_id = s.session_id AND t.sampling_id IN "
            "(SELECT id FROM samplings WHERE instr(CAST(json AS TEXT), ?) > 0))"
        )
        args.append(f.engine)
    if f.version_min is not None or f.version_max is not None:
        lo = f.version_min if f.version_min is not None else -(2**31)
        hi = f.version_max if f.version_max is not None else 2**31 - 1
        where.append(
            "EXISTS (SELECT 1 FROM turns t WHERE t.session_id = s.session_id AND t.n_output > 0 "
            "AND ui_vmax(t.versions) >= ? AND ui_vmin(t.versions) <= ?)"
        )
        args += [lo, hi]
    return where, args


# Both counts read indexes only: (session_id, idx) for every turn, turns_role for the others.
_N_TURNS = "(SELECT COUNT(*) FROM turns t WHERE t.session_id = s.session_id)"
_N_OTHER = "(SELECT COUNT(*) FROM turns t WHERE t.session_id = s.session_id AND t.role != 'main')"

COLUMNS = (
    "s.session_id, s.group_id, s.group_size, s.reward, s.closed, s.created_at, s.lease_id, s.acked, s.rowid, "
    f"{_N_TURNS}, {_N_OTHER}, "
    "(SELECT group_concat(DISTINCT t.role) FROM turns t WHERE t.session_id = s.session_id AND t.role != 'main'), "
    "(SELECT COALESCE(SUM(t.n_output), 0) FROM turns t WHERE t.session_id = s.session_id), "
    "(SELECT COALESCE(MAX(t.n_prompt + t.n_output), 0) FROM turns t WHERE t.session_id = s.session_id), "
    "(SELECT COUNT(*) FROM turns t WHERE t.fork_reason IS NOT NULL AND t.session_id = s.session_id), "
    "(SELECT MIN(ui_vmin(t.versions)) FROM turns t WHERE t.session_id = s.session_id AND t.n_output > 0), "
    "(SELECT MAX(t.created_at) FROM turns t WHERE t.session_id = s.session_id), "
    "EXISTS (SELECT 1 FROM turns t JOIN turn_images ti ON ti.turn_seq = t.seq WHERE t.session_id = s.session_id)"
)


def list_sessions(db, f: SessionFilter, *, version: int, cursor: str | None = None, limit: int = 50) -> dict:
    """One page of sessions, newest first, and the cursor of the next (older) page.

    With an engine or version filter a page looks through at most ``SCAN`` sessions: it may
    hold fewer than ``limit`` rows (``scanned_to`` says how far it looked) and still have a
    next page, so no request reads every turn of a large store.
    """
    limit = max(1, min(int(limit), MAX_LIMIT))
    where, args = _where(f)
    if cursor:
        created, rowid = decode_cursor(cursor)
        where.append("(s.created_at, s.rowid) < (?, ?)")
        args += [created, rowid]
    scanned, scan_args = _scanned(f)
    cond = " WHERE " + " AND ".join(where) if where else ""
    order = " ORDER BY s.created_at DESC, s.rowid DESC"
    window_end = None
    with db.read(snapshot=True) as c:
        register_functions(c)
        if scanned:
            window = c.execute(f"SELECT s.created_at, s.rowid FROM sessions s{cond}{order} LIMIT 1 OFFSET ?", (*args, SCAN - 1)).fetchone()
            if window is not None:  # the SCAN-th candidate: this page looks no further
                window_end = window
                where = [*where, "(s.created_at, s.rowid) >= (?, ?)"]
                args = [*args, *window]
            where += scanned
            args += scan_args
            cond = " WHERE " + " AND ".join(where)
        rows = c.execute(f"SELECT {COLUMNS} FROM sessions s{cond}{order} LIMIT ?", (*args, limit + 1)).fetchall()
    more = len(rows) > limit
    rows = rows[:limit]
    out = []
    for (sid, gid, gsize, reward, closed, created, lease_id, acked, _rowid, n_turns, n_other, other_roles, n_out, n_ctx,
         n_forks, vmin, last, images) in rows:  # fmt: skip
        out.append(
            {
                "session_id": sid,
                "group_id": gid,
                "group_size": gsize,
                "reward": reward,
                "closed": bool(closed),
                "leased": lease_id is not None,
                "acked": bool(acked),
                "created_at": created,
                "turns": n_turns,
                "roles": _roles(n_turns > n_other, other_roles),
                "tokens": n_out,  # sampled tokens, every turn
                "context": n_ctx,  # the longest prompt + output
                "forks": n_forks,
                "oldest_version": vmin,
                "staleness": None if vmin is None else max(0, int(version) - int(vmin)),
                "last_activity": last if last is not None else created,
                "has_images": bool(images),
            }
        )
    if more and rows:
        nxt = encode_cursor(rows[-1][5], rows[-1][8])
    elif window_end is not None:
        nxt = encode_cursor(*window_end)  # the window ran out before the page filled: look further
    else:
        nxt = None
    return {"data": out, "next_cursor": nxt, "has_more": nxt is not None,
            "scanned_to": None if window_end is None else window_end[0]}  # fmt: skip


def _roles(has_main: bool, others: str | None) -> list[str]:
    """The roles a session's turns hold, in ``ROLES`` order (``main`` first)."""
    held = set(others.split(",")) if others else set()
    if has_main:
        held.add("main")
    return [r for r in ROLES if r in held] + sorted(held - set(ROLES))


def fork_reasons(db) -> list[str]:
    """The fork reasons recorded so far (for the filter's choices)."""
    with db.read() as c:
        return [r[0] for r in c.execute("SELECT DISTINCT fork_reason FROM turns WHERE fork_reason IS NOT NULL ORDER BY 1")]


def engines(db) -> list[str]:
    """Engine replicas recorded in turns' sampling records (for the filter's choices)."""
    import orjson

    seen: set[str] = set()
    with db.read() as c:
        for (blob,) in c.execute("SELECT json FROM samplings"):
            eid = orjson.loads(blob).get("engine_id")
            if eid:
                seen.add(eid)
    return sorted(seen)
