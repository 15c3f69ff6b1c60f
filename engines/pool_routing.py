"""The replica set of ``EnginePool``: which replica a session goes to (consistent hashing or
least-loaded, then sticky), failover to the next one, and the health loop that marks replicas
down and up, brings a stale one up to date and follows the engines' weight version forward."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

from engines.replica import Replica, agreed_version
from engines.types import EngineError, EngineRejected, EngineUnavailable

log = logging.getLogger("engines.pool")  # one logger for the pool, whichever file logs


class RoutingMixin:
    """Routing, failover and health checks of ``EnginePool`` (its state lives there)."""

    # -- routing --------------------------------------------------------------------------------

    def replica_for(self, session_id: str) -> str:
        """The replica a new request of ``session_id`` goes to now (sticky unless it is down)."""
        return self._candidates(session_id)[0].url

    def _candidates(self, session_id: str) -> list[Replica]:
        """Ring order for the session: usable replicas first (the owner unless it is down), then
        those believed down (health may be out of date), stale ones last."""
        ring = self._ring.preference(session_id)
        if self._sticky is not None:
            load = {u: r.in_flight for u, r in self._replicas.items()}
            ring = self._sticky.place(session_id, ring, load, lambda u: self._replicas[u].usable)
        order = [self._replicas[u] for u in ring if self._replicas[u].out_of_rotation is None]
        if not order:
            reasons = "; ".join(f"{r.url}: {r.out_of_rotation}" for r in self._replicas.values())
            raise EngineUnavailable(f"every engine replica is out of rotation ({reasons}); publish the weights again", retryable=False)
        return sorted(order, key=lambda r: (r.stale, not r.healthy))  # stable: keeps ring order

    def _note_error(self, replica: Replica, exc: EngineError) -> None:
        if isinstance(exc, EngineUnavailable):
            if replica.healthy:
                log.warning("engine replica %s is unavailable: %s", replica.url, exc)
            replica.healthy = False
        if not exc.replica:
            exc.replica = replica.url

    async def _call_with_failover(
        self, session_id: str, call: Callable[[Replica], Awaitable[Any]], *, may_retry: Callable[[], bool]
    ) -> tuple[Replica, Any]:
        """Run ``call`` on the session's replica; on a retryable failure, once on the next one
        (or, with a single replica, once more on the same one: a kept-alive connection the engine
        closed under load fails before anything was sent back)."""
        candidates = self._candidates(session_id)
        tries = candidates[:2] if len(candidates) > 1 else candidates * 2
        last: EngineError | None = None
        for attempt, replica in enumerate(tries):
            if attempt == 1 and not (last is not None and last.retryable and may_retry() and not replica.stale):
                break
            if attempt == 1 and replica is tries[0]:
                await asyncio.sleep(0.05)
            replica.in_flight += 1
            try:
                return replica, await call(replica)
            except EngineError as exc:
                self._note_error(replica, exc)
                last = exc
            finally:
                replica.in_flight -= 1
            if isinstance(last, EngineRejected):
                break
        assert last is not None
        raise last

    # -- health ---------------------------------------------------------------------------------

    async def health(self) -> dict[str, bool]:
        """Probe every replica now; returns and records ``{url: healthy}``."""
        replicas = list(self._replicas.values())
        oks = await asyncio.gather(*(r.client.health() for r in replicas))
        for r, ok in zip(replicas, oks):
            if ok and not r.healthy:
                r.epoch += 1  # it may be a new process: groups it had joined are gone
            if ok != r.healthy:
                log.info("engine replica %s is %s", r.url, "healthy" if ok else "unhealthy")
            r.healthy = ok
        return {r.url: r.healthy for r in replicas}

    async def _resync(self, r: Replica) -> None:
        """Give a replica that missed a weight update the current weights."""
        if self._model_path is None:
            return
        try:
            await r.client.update_weights(self._model_path, self._version)
        except EngineError as exc:
            log.warning("could not bring %s to v%d: %s", r.url, self._version, exc)
            return
        r.stale = False
        log.info("engine replica %s caught up to v%d", r.url, self._version)

    def _follow_engines(self, *, backwards: bool) -> bool:
        """Adopt the weight version the usable replicas agree on (``backwards``: also when it is
        lower than V, as at start-up, where the engines are the only truth). True if V changed."""
        v = agreed_version([r.version for r in self._replicas.values() if r.usable])
        if v is None or v == self._version or (v < self._version and not backwards):
            return False
        log.info("the engines serve weight version %d: the pool's version follows (was %d)", v, self._version)
        self._version = v
        return True

    async def _poll_versions(self) -> bool:
        """Read every usable replica's weight version; follow the engines forward when they all
        moved (weights published through another proxy without this one being told)."""
        replicas = [r for r in self._replicas.values() if r.usable and r.reports_version]
        if not replicas:
            return False
        await asyncio.gather(*(self._read_version(r) for r in replicas))
        if self._paused:
            return False
        return self._follow_engines(backwards=False)

    async def _health_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.health_interval_s)
            try:
                await self.health()
                for r in self._replicas.values():
                    if r.stale and r.healthy and not self._paused and r.out_of_rotation is None:
                        await self._resync(r)
                await self._lift_completed()
                self.expire_transfers()
                if not self._paused:
                    await self._poll_versions()
            except Exception:  # noqa: BLE001 - the loop must survive anything
                log.exception("engine health check failed")
