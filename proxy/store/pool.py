"""The training pool: ready samples leased to the trainer, acked or returned on timeout.

A pull runs in two steps so a large pull never stalls turns: samples are assembled from a
read snapshot without the writer's lock, then one short write transaction leases exactly
the sessions that are still free (a concurrent pull that took one first wins it).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Callable

from . import leases
from .db import Database
from .errors import Conflict, NotFound
from .samples import Sample, assemble_samples
from .sessions import read_session
from .turns import TurnTable


@dataclass
class Lease:
    """Sessions leased to the trainer, in hand-out order; ``lease_id`` None when nothing was ready."""

    lease_id: str | None
    session_ids: list[str] = field(default_factory=list)
    n_samples: int = 0
    dropped: int = 0  # samples dropped from the pool by ``keep`` (``--max-staleness``)


class TrainingPool:
    def __init__(self, db: Database, turns: TurnTable, clock: Callable[[], float] = time.time):
        self.db = db
        self.turns = turns
        self.clock = clock
        self.train_auxiliary = False  # --train-auxiliary: harness side calls are handed out as samples too

    def pull(
        self, max_samples: int, lease_timeout_s: float, *, keep: Callable[[Sample], bool] | None = None
    ) -> tuple[str | None, list[dict]]:
        """``lease`` then every leased sample as a dict of Python lists (small pulls, tests)."""
        lease = self.lease(max_samples, lease_timeout_s, keep=keep)
        if lease.lease_id is None:
            return None, []
        return lease.lease_id, [s.to_dict() for s in self.samples(lease.session_ids, keep=keep)]

    def lease(self, max_samples: int, lease_timeout_s: float, *, keep: Callable[[Sample], bool] | None = None) -> Lease:
        """Lease ready samples: whole sessions, whole groups, oldest-ready first.

        Returns an empty ``Lease`` when nothing is ready (no lease is created). A unit (session
        or complete group) that does not fit in what is left of ``max_samples`` waits for the
        next pull, unless it is the first of the lease, so an oversized group is never stuck.
        Rewarded sessions without any turn have nothing to train on and are acked on the spot.
        Samples are counted here one session at a time and dropped; ``samples`` assembles them
        again while they are sent, so memory is bounded by one session, not by the lease.
        ``keep(sample)`` False drops a sample from the pool (``--max-staleness``): it is never
        handed out (pass the same ``keep`` to ``samples``), and a session left with nothing to
        hand out is acked on the spot too. ``Lease.dropped`` counts the samples dropped from
        the sessions this call leased or acked.
        """
        if lease_timeout_s <= 0:
            raise ValueError("lease_timeout_s must be positive")
        if max_samples <= 0:
            return Lease(None)
        now = self.clock()
        with self.db.write() as c:  # short: return timed-out leases to the pool
            leases.expire_leases(c, now)
        chosen: list[tuple[list[str], int]] = []
        empty: list[str] = []
        dropped_in: dict[str, int] = {}  # first session of a unit -> samples dropped from it
        n = 0
        with self.db.read(snapshot=True) as c:
            for unit in leases.ready_units(c):
                if n >= max_samples:
                    break
                count = dropped = 0
                for session_id in unit.session_ids:
                    session = read_session(c, session_id)
                    for sample in assemble_samples(session, self.turns.iter_tokens(c, session_id), train_auxiliary=self.auxiliary_pulled(c, session_id)):
                        if keep is None or keep(sample):
                            count += 1
                        else:
                            dropped += 1
                if not count:
                    empty.extend(unit.session_ids)
                    dropped_in[unit.session_ids[0]] = dropped
                    continue
                if chosen and n + count > max_samples:
                    continue
                chosen.append((unit.session_ids, count))
                dropped_in[unit.session_ids[0]] = dropped
                n += count
        with self.db.write() as c:
            free = leases.still_free(c, [s for ids, _ in chosen for s in ids] + empty)
            leases.mark_acked(c, [s for s in empty if s in free])
            dropped = sum(dropped_in.get(s, 0) for s in empty if s in free)
            taken: list[str] = []
            n_samples = 0
            for ids, count in chosen:
                if all(s in free for s in ids):  # a unit is leased whole or not at all
                    taken.extend(ids)
                    n_samples += count
                    dropped += dropped_in.get(ids[0], 0)
            if not taken:
                return Lease(None, dropped=dropped)
            lease_id = "lease_" + uuid.uuid4().hex
            leases.create_lease(c, lease_id, taken, n_samples, now, lease_timeout_s)
        return Lease(lease_id, taken, n_samples, dropped)

    def auxiliary_pulled(self, c, session_id: str) -> bool:
        """Whether the session's auxiliary turns are handed out: with --train-auxiliary, and in a
        session that has nothing else (a task whose only calls look like side calls, e.g. a
        structured-output answer without tools, is still an episode to learn from)."""
        if self.train_auxiliary:
            return True
        return c.execute("SELECT 1 FROM turns WHERE session_id = ? AND role != 'auxiliary' LIMIT 1", (session_id,)).fetchone() is None

    def samples(self, session_ids: list[str], *, keep: Callable[[Sample], bool] | None = None) -> Iterator[Sample]:
        """The samples of ``session_ids``, one session at a time, each read from its own snapshot
        (those ``keep`` accepts, when given)."""
        for session_id in session_ids:
            with self.db.read(snapshot=True) as c:
                session = read_session(c, session_id)
                samples = assemble_samples(session, self.turns.iter_tokens(c, session_id), train_auxiliary=self.auxiliary_pulled(c, session_id)) if session is not None else []
            yield from (s for s in samples if keep is None or keep(s))

    def rewarded(self, *, since: float | None = None, acked: bool = False, after: tuple[float, str] | None = None,
                 limit: int = 1000) -> list[tuple[float, str]]:
        """``(rewarded_at, session_id)`` of rewarded sessions, oldest first, without leasing them
        (export): those the trainer has not acked yet, and with ``acked`` those it has too."""
        sql = "SELECT rewarded_at, session_id FROM sessions WHERE reward IS NOT NULL"
        args: list = []
        if not acked:
            sql += " AND acked = 0"
        if since is not None:
            sql += " AND rewarded_at >= ?"
            args.append(since)
        if after is not None:
            sql += " AND (rewarded_at > ? OR (rewarded_at = ? AND session_id > ?))"
            args += [after[0], after[0], after[1]]
        sql += " ORDER BY rewarded_at, session_id LIMIT ?"
        args.append(int(limit))
        with self.db.read(snapshot=True) as c:
            return [(float(r[0]), r[1]) for r in c.execute(sql, args).fetchall()]

    def ack(self, lease_id: str) -> None:
        """The trainer consumed the lease's samples: its sessions are never handed out again.

        Acking an acked lease again is a no-op (a retried request). Unknown lease: NotFound.
        A lease past its timeout: Conflict (its samples went back to the pool and may be
        handed out again).
        """
        with self.db.write() as c:
            now = self.clock()
            outcome = leases.ack_lease(c, lease_id, now)
            expires_at = leases.lease_expiry(c, lease_id)
        if outcome == "unknown":
            raise NotFound(f"no lease {lease_id!r}")
        if outcome == "expired":
            raise Conflict(
                f"lease {lease_id!r} expired at {expires_at:.3f} (now {now:.3f}) before it was acked; "
                "its samples went back to the pool"
            )
