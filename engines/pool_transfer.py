"""The proxy's side of an in-memory weight transfer (docs/weight_transfer.md): the engines' group
joins and bucket calls relayed, replicas taken out of rotation while their weights may be mixed,
put back by a complete publish, and abandoned transfers expired."""

from __future__ import annotations

import logging
import time

from engines.replica import Replica, back_in_rotation, engine_id
from engines.resume import parse_version
from engines.types import EngineError
from engines.weight_transfer import TensorBatch, WeightGroup

log = logging.getLogger("engines.pool")  # one logger for the pool, whichever file logs


class TransferMixin:
    """The ``/admin/weights/*`` operations of ``EnginePool`` (its state lives there)."""

    # -- weights over torch.distributed (docs/weight_transfer.md) ------------------------------

    def _by_id(self, engine: str) -> Replica:
        by_id = {r.id: r for r in self._replicas.values()}
        r = by_id.get(engine_id(engine))
        if r is None:
            raise ValueError(f"unknown engine {engine!r}; this proxy's engines are {sorted(by_id)}")
        return r

    async def weight_ranks(self, engine: str) -> int:
        """How many ranks ``engine`` joins a weight-update group with (its GPUs)."""
        return await self._by_id(engine).client.weight_ranks()

    async def init_weights_group(self, engine: str, group: WeightGroup) -> None:
        """Make the engine join ``group`` (the trainer joins as rank 0 meanwhile)."""
        r = self._by_id(engine)
        if r.transfer_seen is not None:  # joining is part of the pending transfer: news of it
            r.transfer_seen = time.monotonic()
            r.transfer_touched = True
        try:
            await r.client.init_weights_group(group)
        except EngineError as exc:
            self._note_error(r, exc)
            raise
        r.healthy = True

    async def destroy_weights_group(self, engine: str, group_name: str) -> None:
        r = self._by_id(engine)
        await r.client.destroy_weights_group(group_name)

    def begin_transfer(self, engines: list[str], version: int) -> list[str]:
        """Take the replicas of ``engines`` (those this proxy has) out of rotation before their
        weights start changing; returns their ids. A complete transfer puts them back."""
        wanted = {engine_id(e) for e in engines}
        self._transfer = (int(version), frozenset(wanted))
        marked = []
        now = time.monotonic()
        for r in self._replicas.values():
            if r.id in wanted:
                r.out_of_rotation = f"receiving weights v{int(version)}"
                r.target_version = int(version)
                if r.transfer_seen is None:
                    r.transfer_touched = False
                r.transfer_seen = now
                marked.append(r.id)
        return marked

    async def update_weights_from_distributed(self, engine: str, batch: TensorBatch) -> None:
        """One bucket to one engine; the final bucket stamps ``batch.version`` and puts the
        replica back in rotation. A failed bucket leaves it out, with the reason."""
        r = self._by_id(engine)
        r.out_of_rotation = r.out_of_rotation or f"receiving weights v{batch.version}"
        r.target_version = batch.version
        r.transfer_seen = time.monotonic()
        r.transfer_touched = True  # whatever the engine answers, its weights may have begun to change
        try:
            await r.client.update_weights_from_distributed(batch)
        except EngineError as exc:
            self._note_error(r, exc)
            r.out_of_rotation = f"the transfer of v{batch.version} stopped half way: {exc}"
            raise
        r.healthy = True
        if batch.final:
            r.version = batch.version
            r.stale = False
            back_in_rotation(r)

    def commit_transfer(self, version: int, updated: list[str], failed: dict[str, str]) -> dict[str, list[str]]:
        """After a fleet transfer: engines in ``updated`` serve ``version`` (back in rotation),
        those in ``failed`` stay out with the reason. V becomes ``version`` when an engine of
        this transfer has it; the weights of V live on no filesystem, so a stale replica is no
        longer reloaded from an older path.

        An engine counts only if it is one of this proxy's or was named by the ``begin`` of this
        version (a fleet's commit names every engine of the fleet); others are returned as
        ``ignored``, and a commit naming none at all is a ``ValueError``: a stray or mistaken
        commit never moves the version."""
        known = {r.id for r in self._replicas.values()}
        if self._transfer is not None and self._transfer[0] == int(version):
            known |= self._transfer[1]
        ok = {engine_id(e) for e in updated} & known
        bad = {engine_id(e): why for e, why in failed.items() if engine_id(e) in known}
        ignored = sorted({engine_id(e) for e in [*updated, *failed]} - known)
        if not ok and not bad:
            raise ValueError(
                f"the commit of v{int(version)} names no engine of this proxy or of a transfer of v{int(version)} begun here "
                f"(it names {ignored or 'none'}; this proxy's engines are {sorted(r.id for r in self._replicas.values())})"
            )
        now = time.monotonic()
        for r in self._replicas.values():
            if r.id in ok:
                r.version = int(version)
                r.stale = False
                back_in_rotation(r)
            elif r.id in bad:
                r.out_of_rotation = f"the transfer of v{int(version)} did not complete: {bad[r.id]}"
                r.target_version = int(version)
                r.transfer_seen = now
                r.transfer_touched = True
        if ok:
            self._version = int(version)
            self._model_path = None
        return {"ignored": ignored}

    def expire_transfers(self, now: float | None = None) -> list[str]:
        """Replicas out of rotation for a transfer with no news for ``transfer_deadline_s``.

        Their weights may be mixed (a fleet's other proxies may have sent buckets this one never
        saw), so none goes back as it is. When V's weights are on disk (the last publish was a
        load from a path), the replica is marked stale and reloaded from that path by the health
        check, then serves again; otherwise it stays out, its status saying the transfer was
        abandoned and that a publish brings it back. Logged once (WARNING) and counted."""
        now = time.monotonic() if now is None else now
        expired = []
        for r in self._replicas.values():
            if r.out_of_rotation is None or r.transfer_seen is None or now - r.transfer_seen < self.transfer_deadline_s:
                continue
            target = r.target_version
            r.transfer_seen = None  # expired once
            self.expired_transfers += 1
            expired.append(r.id)
            if self._model_path is not None:
                log.warning("the weight transfer of v%s to %s was abandoned (no news for %g s): reloading v%d from %s",
                            target, r.url, self.transfer_deadline_s, self._version, self._model_path)  # fmt: skip
                back_in_rotation(r)
                r.stale = True  # not routed to until the health check reloads the path
                continue
            touched = "its weights may be mixed" if r.transfer_touched else "its weights may be mixed (another proxy may have sent buckets)"
            r.out_of_rotation = (
                f"the transfer of v{target} was abandoned: no join, bucket or commit for {self.transfer_deadline_s:g} s; "
                f"{touched}; a publish (a disk load or a new transfer) brings it back"
            )
            log.warning("engine replica %s stays out of rotation: %s", r.url, r.out_of_rotation)
        return expired

    async def _lift_completed(self, *, force: bool = False) -> None:
        """Put back in rotation a replica whose engine now reports the version its interrupted
        transfer was for (a later publish completed it, through this proxy or another)."""
        out = [r for r in self._replicas.values() if r.out_of_rotation is not None and r.target_version is not None and r.healthy]
        for r in out:
            try:
                now = parse_version(await r.client.weight_version())
            except Exception:  # noqa: BLE001 - cannot tell: stays out
                continue
            if now == r.target_version and (force or not self._paused):
                log.info("engine replica %s completed v%d: back in rotation", r.url, now)
                r.version = now
                back_in_rotation(r)
