"""Pause, resume and weight updates from disk across ``EnginePool``'s replicas: all-or-nothing
pause, idempotent ``update_weights`` (a replica already at the version is skipped), a replica
that was down marked stale."""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from engines.replica import Replica, back_in_rotation, engine_id
from engines.resume import parse_version
from engines.types import EngineError, EngineUnavailable
from engines.vllm_wire import TIED_HEAD_WARNING

log = logging.getLogger("engines.pool")  # one logger for the pool, whichever file logs


class WeightsMixin:
    """``pause`` / ``resume`` / ``update_weights`` of ``EnginePool`` (its state lives there)."""

    # -- admin ----------------------------------------------------------------------------------

    async def _broadcast(
        self, what: str, op: Callable[[Replica], Awaitable[None]], replicas: list[Replica] | None = None
    ) -> list[Replica]:
        """Run ``op`` on every replica (or those given) concurrently. Returns the replicas that were
        unreachable; raises when a reachable replica failed or none succeeded."""
        replicas = list(self._replicas.values()) if replicas is None else replicas
        results = await asyncio.gather(*(op(r) for r in replicas), return_exceptions=True)
        down: list[Replica] = []
        errors: list[str] = []
        for r, res in zip(replicas, results):
            if isinstance(res, EngineUnavailable):
                self._note_error(r, res)
                down.append(r)
            elif isinstance(res, BaseException):
                errors.append(f"{r.url}: {res}")
        if errors or len(down) == len(replicas):
            detail = "; ".join(errors or [f"{r.url} unavailable" for r in down])
            err_types = {type(res) for res in results if isinstance(res, EngineError)}
            cls = err_types.pop() if len(err_types) == 1 else EngineError
            raise cls(f"{what} failed: {detail}", retryable=False)
        return down

    async def pause(self) -> None:
        """Pause every replica (mode abort). In-flight requests come back partial and are held.

        All or nothing: if a reachable replica fails to pause, the replicas that paused are
        resumed, the pool is left unpaused (held requests go on) and the failing replica's error
        is raised, naming it. An unreachable replica is skipped as in every broadcast (it serves
        nothing; a weight update then marks it stale); all of them unreachable is an error.
        """
        self._paused = True
        self._resumed.clear()
        replicas = list(self._replicas.values())
        results = await asyncio.gather(*(r.client.pause() for r in replicas), return_exceptions=True)
        paused = [r for r, res in zip(replicas, results) if not isinstance(res, BaseException)]
        failed: list[tuple[Replica, BaseException]] = []
        for r, res in zip(replicas, results):
            if isinstance(res, EngineUnavailable):
                self._note_error(r, res)
            elif isinstance(res, BaseException):
                failed.append((r, res))
        if not failed and paused:
            return
        if not failed:  # every replica unreachable
            failed = [(r, res) for r, res in zip(replicas, results) if isinstance(res, BaseException)]
        undo = await asyncio.gather(*(r.client.resume() for r in paused), return_exceptions=True)
        not_resumed = [r.url for r, res in zip(paused, undo) if isinstance(res, BaseException)]
        self._paused = False
        self._resumed.set()
        first_r, first_exc = failed[0]
        detail = "; ".join(f"{r.url}: {exc}" for r, exc in failed)
        msg = f"pause failed on {', '.join(r.url for r, _ in failed)} ({detail}); resumed {len(paused) - len(not_resumed)} replica(s) that had paused; the pool is not paused"
        if not_resumed:
            msg += f"; could not resume {', '.join(not_resumed)}"
        cls = type(first_exc) if isinstance(first_exc, EngineError) else EngineError
        try:
            err = cls(msg, replica=first_r.url, retryable=False)
        except TypeError:
            err = EngineError(msg, replica=first_r.url, retryable=False)
        raise err from first_exc

    async def resume(self) -> None:
        """Resume every replica; held requests re-send (and pick up their proximal values)."""
        await self._lift_completed(force=True)  # a publish through other proxies may have completed them
        try:
            await self._broadcast("resume", lambda r: r.client.resume())
        finally:
            self._paused = False
            self._resumed.set()

    async def update_weights(self, model_path: str, version: int, *, engines: list[str] | None = None) -> dict[str, list[str]]:
        """Load ``model_path`` on every replica (or only those whose ``id`` is in ``engines``) as
        ``version``, then make it V. A replica whose engine already reports ``version`` is not
        loaded again (a re-run publish is idempotent). Returns ``{"loaded": [...], "skipped":
        [...], "stale": [...]}`` (replica ids).

        A replica that is down is marked stale (no traffic) and brought up to date by the health
        loop when it returns; V is set as long as one replica has the new weights. When a
        reachable replica fails to load them this raises ``EngineError`` and V is unchanged
        (retry the update). ``model_path`` is a path on the engines' filesystem, passed untouched
        (SGLang ``/update_weights_from_disk``; vLLM dev mode ``/collective_rpc`` reload_weights,
        then ``/update_weight_version``, read back from ``/weight_info``); a vLLM without dev mode
        raises ``EngineUnsupported`` (use ``set_version``).
        """

        selected: list[Replica] | None = None
        if engines is not None:
            by_id = {r.id: r for r in self._replicas.values()}
            unknown = [e for e in engines if engine_id(e) not in by_id]
            if unknown:
                raise ValueError(f"unknown engine(s) {unknown}; this proxy's engines are {sorted(by_id)}")
            selected = [by_id[engine_id(e)] for e in dict.fromkeys(engines)]
        loaded: list[str] = []
        skipped: list[str] = []

        async def load(r: Replica) -> None:
            try:
                now = parse_version(await r.client.weight_version())
            except EngineUnavailable:
                raise
            except Exception:  # noqa: BLE001 - cannot tell: load (loading twice is only slower)
                now = None
            if now == int(version):
                skipped.append(r.id)  # already serving this version: do not load it twice
            else:
                await r.client.update_weights(model_path, version)
                loaded.append(r.id)
            r.version = int(version)
            r.stale = False
            back_in_rotation(r)  # whole weights again

        if self.kind == "vllm" and self._info.tied_lm_head and not self._info.worker_extension:
            log.warning("vLLM update_weights(%r): %s", model_path, TIED_HEAD_WARNING)
        if selected == []:
            down: list[Replica] = []
        else:
            down = await self._broadcast(f"update_weights({model_path!r}, v{version})", load, selected)
        for r in down:
            r.stale = True
        self._model_path = model_path
        self._version = int(version)
        await self._lift_completed(force=True)  # replicas whose interrupted transfer this load completed (via another proxy)
        return {"loaded": loaded, "skipped": skipped, "stale": [r.id for r in down]}
