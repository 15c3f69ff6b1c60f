"""The training pool: ready samples leased to the trainer, acked or returned on timeout.

A pull runs in two steps so a large pull never stalls turns: samples are assembled from a
read snapshot without the writer's lock, then one short write transaction leases exactly
the sessions that are still free (a concurrent pull that took one first wins it).
"""

from __future__ import annotations

import time
import uuid
from typing import Callable

from . import leases
from .db import Database
from .errors import Conflict, NotFound
from .samples import assemble_samples
from .sessions import read_session
from .turns import TurnTable


class TrainingPool:
    def __init__(self, db: Database, turns: TurnTable, clock: Callable[[], float] = time.time):
        self.db = db
        self.turns = turns
        self.clock = clock

    def pull(
        self, max_samples: int, lease_timeout_s: float, *, keep: Callable[[dict], bool] | None = None
    ) -> tuple[str | None, list[dict]]:
        """Lease ready samples: whole sessions, whole groups, oldest-ready first.

        Returns ``(None, [])`` when nothing is ready (no lease is created). A unit (session or
        complete group) that does not fit in what is left of ``max_samples`` waits for the next
        pull, unless it is the first of the lease, so an oversized group is never stuck.
        Rewarded sessions without any turn have nothing to train on and are acked on the spot.
        ``keep(sample)`` False drops a sample from the pool (``--max-staleness``): it is never
        handed out, and a session left with nothing to hand out is acked on the spot too.
        """
        if lease_timeout_s <= 0:
            raise ValueError("lease_timeout_s must be positive")
        if max_samples <= 0:
            return None, []
        now = self.clock()
        with self.db.write() as c:  # short: return timed-out leases to the pool
            leases.expire_leases(c, now)
        chosen: list[tuple[list[str], list[dict]]] = []
        empty: list[str] = []
        n = 0
        with self.db.read(snapshot=True) as c:
            for unit in leases.ready_units(c):
                if n >= max_samples:
                    break
                unit_samples: list[dict] = []
                for session_id in unit.session_ids:
                    session = read_session(c, session_id)
                    unit_samples.extend(s.to_dict() for s in assemble_samples(session, self.turns.list_in(c, session_id)))
                if keep is not None:
                    unit_samples = [s for s in unit_samples if keep(s)]
                if not unit_samples:
                    empty.extend(unit.session_ids)
                    continue
                if chosen and n + len(unit_samples) > max_samples:
                    continue
                chosen.append((unit.session_ids, unit_samples))
                n += len(unit_samples)
        with self.db.write() as c:
            free = leases.still_free(c, [s for ids, _ in chosen for s in ids] + empty)
            leases.mark_acked(c, [s for s in empty if s in free])
            taken: list[str] = []
            samples: list[dict] = []
            for ids, unit_samples in chosen:
                if all(s in free for s in ids):  # a unit is leased whole or not at all
                    taken.extend(ids)
                    samples.extend(unit_samples)
            if not samples:
                return None, []
            lease_id = "lease_" + uuid.uuid4().hex
            leases.create_lease(c, lease_id, taken, len(samples), now, lease_timeout_s)
        return lease_id, samples

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
