"""The fleet weight-update protocol's shared pieces (docs/fleet.md): the report, the error, the
plan of which proxy loads which engine, and the steps as calls on a client.

The protocol itself is described in ``trainer_bridge.publish`` (the entry point and ``splice
publish``). This module sits below both ``client`` (whose ``ProxyClient.publish`` runs
:func:`run_publish` on itself) and ``weight_transfer`` (the distributed transfer runs the same
steps with a broadcast in the middle): it takes the client as an argument and imports neither.
Talks to the proxies over HTTP only (``trainer_bridge`` never imports the proxy).
"""

from __future__ import annotations

import time
import urllib.parse
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import ProxyError


@dataclass
class PublishReport:
    """What a publish did. ``loaders``: engine id -> the proxy that loaded it."""

    version: int
    model_path: str
    proxies: list[str]
    engines: list[str] = field(default_factory=list)  # distinct engine ids across the fleet
    loaders: dict[str, str] = field(default_factory=dict)
    loaded: list[str] = field(default_factory=list)  # engines that loaded the weights now
    skipped: list[str] = field(default_factory=list)  # engines already serving the version
    stale: list[str] = field(default_factory=list)  # unreachable engines, brought up to date when back
    recomputed_tokens: int = 0
    timings_s: dict[str, float] = field(default_factory=dict)
    ok: bool = False
    error: str | None = None
    warnings: list[str] = field(default_factory=list)
    transfer: str = "disk"  # "disk" (model_path) or "distributed" (torch.distributed broadcast)
    failed: dict[str, str] = field(default_factory=dict)  # engine id -> why its transfer did not complete
    bytes_sent: int = 0  # distributed: bytes broadcast to each engine
    buckets: int = 0
    groups_made: int = 0  # distributed: weight-update groups made by this publish (0: all kept)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class PublishError(ProxyError):
    """A publish step failed; every proxy was resumed. ``step`` is one of status, pause, load,
    version, resume; ``proxy`` the proxy that failed, ``engines`` the engines it was loading;
    ``status`` / ``code`` those of the proxy's error reply, when it sent one."""

    def __init__(self, step: str, proxy: str, message: str, report: PublishReport, *, engines: Sequence[str] = (), cause: BaseException | None = None):
        where = f" on engine(s) {', '.join(engines)}" if engines else ""
        super().__init__(f"publish v{report.version}: {step} failed at proxy {proxy}{where}: {message}")
        if isinstance(cause, ProxyError):
            self.status, self.type, self.code = cause.status, cause.type, cause.code
        self.url = proxy
        self.step = step
        self.proxy = proxy
        self.engines = list(engines)
        self.report = report
        self.cause = cause
        report.error = str(self)


def engine_replicas(status: dict[str, Any]) -> list[dict[str, Any]]:
    """A proxy's engines from its ``/admin/status``: ``[{"id", "healthy", ...}]``.

    Uses ``engines.engine_replicas`` (ids); a proxy that predates it is described by its replica
    URLs (scheme and host lower-cased, no trailing slash), which is the same identity."""
    eng = status.get("engines") or {}
    reps = eng.get("engine_replicas")
    if isinstance(reps, list):
        return [r for r in reps if isinstance(r, dict) and r.get("id")]
    out = []
    for r in eng.get("replicas") or []:
        if isinstance(r, dict) and r.get("url"):
            out.append({**r, "id": _normalize(str(r["url"]))})
    return out


def _normalize(url: str) -> str:
    parts = urllib.parse.urlsplit(url.strip().rstrip("/"))
    userinfo, at, hostport = parts.netloc.rpartition("@")
    return urllib.parse.urlunsplit((parts.scheme.lower(), f"{userinfo}{at}{hostport.lower()}", parts.path.rstrip("/"), parts.query, ""))


def plan_loads(statuses: Sequence[dict[str, Any]]) -> tuple[list[str], dict[str, int]]:
    """(distinct engine ids in first-seen order, engine id -> index of the proxy that loads it).

    Each engine goes to a proxy that sees it healthy (else to any proxy that has it), spreading
    engines over proxies so loads run in parallel through different proxies."""
    engines: list[str] = []
    holders: dict[str, list[tuple[int, bool]]] = {}
    for i, st in enumerate(statuses):
        for rep in engine_replicas(st):
            eid = str(rep["id"])
            if eid not in holders:
                engines.append(eid)
                holders[eid] = []
            holders[eid].append((i, bool(rep.get("healthy", True)) and not rep.get("stale", False)))
    assigned: dict[str, int] = {}
    count: dict[int, int] = {}
    for eid in engines:
        good = [i for i, ok in holders[eid] if ok] or [i for i, _ in holders[eid]]
        pick = min(good, key=lambda i: (count.get(i, 0), i))
        assigned[eid] = pick
        count[pick] = count.get(pick, 0) + 1
    return engines, assigned


def parallel(fn: Callable[[int], Any], indices: Sequence[int]) -> list[tuple[int, Any, BaseException | None]]:
    if not indices:
        return []
    if len(indices) == 1:
        i = indices[0]
        try:
            return [(i, fn(i), None)]
        except Exception as exc:  # noqa: BLE001
            return [(i, None, exc)]
    with ThreadPoolExecutor(max_workers=min(32, len(indices))) as ex:
        futs = [(i, ex.submit(fn, i)) for i in indices]
        out = []
        for i, f in futs:
            try:
                out.append((i, f.result(), None))
            except Exception as exc:  # noqa: BLE001
                out.append((i, None, exc))
        return out


def recompute_then_pause(client, every: Sequence[int], urls: Sequence[str], report) -> list:
    """Owed recomputes on every proxy, then (only then) every proxy pauses its engines without
    recomputing again: a proxy's pause never waits on another proxy's recompute. Returns the
    pause results; a proxy without ``/admin/recompute`` (404) pauses as before."""
    results = parallel(lambda i: client.admin(i, "/admin/recompute"), every)
    for i, _, exc in results:
        if exc is not None and not (isinstance(exc, ProxyError) and exc.status == 404):
            report.warnings.append(f"{urls[i]}: recompute before pause failed: {error_message(exc)}")
    report.recomputed_tokens = sum(int((res or {}).get("recomputed_tokens") or 0) for _, res, exc in results if exc is None)
    return parallel(lambda i: client.admin(i, "/admin/pause?recompute=false"), every)


def error_message(exc: BaseException) -> str:
    return exc.message if isinstance(exc, ProxyError) and exc.message else str(exc)


def run_publish(client: Any, model_path: str, version: int, before_resume: Callable[[str], None] | None = None) -> PublishReport:
    """The disk protocol (``trainer_bridge.publish``) through ``client`` (a ``ProxyClient``, which the
    caller owns and closes). Raises :class:`PublishError` (every proxy resumed) when a step fails."""
    urls = list(client.urls)
    every = list(range(len(urls)))
    report = PublishReport(version=version, model_path=model_path, proxies=urls)
    lap = Laps(report)

    def fail_first(step: str, results, engines_of: Callable[[int], Sequence[str]] = lambda i: ()) -> None:
        bad = [(i, exc) for i, _, exc in results if exc is not None]
        if bad:
            i, exc = bad[0]
            others = "; ".join(f"{urls[j]}: {error_message(e)}" for j, e in bad[1:])
            msg = error_message(exc) + (f" (also failed: {others})" if others else "")
            raise PublishError(step, urls[i], msg, report, engines=engines_of(i), cause=exc)

    # 1. what each proxy's engines are (nothing is paused yet). One proxy needs no plan: it loads
    #    all of its engines. A proxy whose status does not list its engines does the same.
    groups: dict[int, list[str] | None] = {}
    if len(urls) == 1:
        groups[0] = None
    else:
        results = parallel(lambda i: client.status(i), every)
        fail_first("status", results)
        statuses = [res if isinstance(res, dict) else {} for _, res, _ in results]
        engines, assigned = plan_loads(statuses)
        report.engines = engines
        report.loaders = {e: urls[i] for e, i in assigned.items()}
        for eid, i in assigned.items():
            groups.setdefault(i, []).append(eid)  # type: ignore[union-attr]
        for i, st in enumerate(statuses):
            if not engine_replicas(st):
                groups[i] = None
    lap("status")

    try:
        # 2. every proxy runs its owed recomputes, then (only then) every proxy pauses its engines
        if len(urls) == 1:
            results = parallel(lambda i: client.admin(i, "/admin/pause"), every)
        else:
            results = recompute_then_pause(client, every, urls, report)
        report.recomputed_tokens += sum(int((res or {}).get("recomputed_tokens") or 0) for _, res, exc in results if exc is None)
        fail_first("pause", results)
        lap("pause")

        # 3. each distinct engine loads the weights once, through one proxy
        def load(i: int) -> dict[str, Any]:
            body: dict[str, Any] = {"model_path": model_path, "version": version}
            if groups[i] is not None:
                body["engines"] = groups[i]
            return client.admin(i, "/admin/update_weights", body)

        results = parallel(load, sorted(groups))
        for _, res, exc in results:
            if exc is None and isinstance(res, dict):
                report.loaded += list(res.get("loaded") or [])
                report.skipped += list(res.get("skipped") or [])
                report.stale += list(res.get("stale") or [])
        fail_first("load", results, engines_of=lambda i: groups.get(i) or [])
        lap("load")

        # 4. every other proxy learns the version (before any proxy resumes)
        rest = [i for i in every if i not in groups]
        results = parallel(lambda i: client.admin(i, "/admin/version", {"version": version, "model_path": model_path}), rest)
        fail_first("version", results)
        lap("version")
    except BaseException:
        resume_all(client, urls, every, None)  # none is left paused; the original error wins
        raise

    # 5. every proxy resumes
    resume_and_time(client, urls, every, before_resume, report, lap)
    report.ok = True
    return report


class Laps:
    """``lap(name)`` records the seconds since the previous lap in ``report.timings_s``."""

    def __init__(self, report: PublishReport):
        self.report = report
        self.start = self.clock = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.report.timings_s[name] = round(now - self.clock, 4)
        self.clock = now


def resume_and_time(client: Any, urls: list[str], every: list[int], before: Callable[[str], None] | None,
                     report: PublishReport, lap: Laps) -> None:
    """The last step of a publish: every proxy resumes; the first that could not is the error."""
    bad = resume_all(client, urls, every, before)
    lap("resume")
    report.timings_s["total"] = round(time.perf_counter() - lap.start, 4)
    if bad:
        i, exc = bad[0]
        raise PublishError("resume", urls[i], error_message(exc), report, cause=exc)


def resume_all(client: Any, urls: list[str], every: list[int], before: Callable[[str], None] | None) -> list[tuple[int, BaseException]]:
    def resume(i: int) -> Any:
        if before is not None:
            before(urls[i])
        return client.admin(i, "/admin/resume")

    return [(i, exc) for i, _, exc in parallel(resume, every) if exc is not None]
