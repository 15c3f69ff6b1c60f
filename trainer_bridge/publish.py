"""Publishing new weights to a Splice fleet: many proxies sharing engines (docs/fleet.md).

The protocol, for any trainer (``splice publish`` runs it from the command line)::

    1. status   GET  /admin/status          on every proxy: its engines (stable ids) and health
    2. pause    POST /admin/recompute       on every proxy: owed recomputes (R2), all before any
                                            pause (a paused engine would hold another proxy's
                                            recompute), then POST /admin/pause?recompute=false
    3. load     POST /admin/update_weights  {"model_path", "version", "engines": [ids]} on ONE
                                            proxy per distinct engine: each engine loads once
    4. version  POST /admin/version         {"version", "model_path"} on every other proxy
    5. resume   POST /admin/resume          on every proxy

Every proxy learns the version (3 or 4) before any proxy resumes (5), so no proxy sends a
request under weights it has not been told about; and tokens are stamped with the version the
engine reports, so even a proxy outside the protocol records exact versions. Each step runs on
all proxies concurrently. A failure at any step resumes every proxy (none is left paused) and
raises :class:`PublishError` naming the step, the proxy and, for a load, the engines. Re-running
with the same version is safe: an engine that already reports the version is not loaded again.

Talks to the proxies over HTTP only (``trainer_bridge`` never imports the proxy).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from .client import ProxyClient, ProxyError, resolve_proxies


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


def _parallel(fn: Callable[[int], Any], indices: Sequence[int]) -> list[tuple[int, Any, BaseException | None]]:
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


def _recompute_then_pause(client, every: Sequence[int], urls: Sequence[str], report) -> list:
    """Owed recomputes on every proxy, then (only then) every proxy pauses its engines without
    recomputing again: a proxy's pause never waits on another proxy's recompute. Returns the
    pause results; a proxy without ``/admin/recompute`` (404) pauses as before."""
    results = _parallel(lambda i: client.admin(i, "/admin/recompute"), every)
    for i, _, exc in results:
        if exc is not None and not (isinstance(exc, ProxyError) and exc.status == 404):
            report.warnings.append(f"{urls[i]}: recompute before pause failed: {_message(exc)}")
    report.recomputed_tokens = sum(int((res or {}).get("recomputed_tokens") or 0) for _, res, exc in results if exc is None)
    return _parallel(lambda i: client.admin(i, "/admin/pause?recompute=false"), every)


def _message(exc: BaseException) -> str:
    return exc.message if isinstance(exc, ProxyError) and exc.message else str(exc)


def publish(
    proxies: str | Sequence[str],
    model_path: str,
    version: int,
    admin_token: str | None = None,
    *,
    client: ProxyClient | None = None,
    timeout_s: float = 600.0,
    before_resume: Callable[[str], None] | None = None,
) -> PublishReport:
    """Run the fleet weight-update protocol (module docstring); returns a :class:`PublishReport`.

    ``proxies``: base URLs, or ``dns://NAME:PORT`` entries resolved to every address of the name.
    ``model_path`` is a path on the engines' filesystem, passed through untouched. Raises
    :class:`PublishError` (every proxy resumed) when a step fails. ``before_resume(url)`` runs
    just before each proxy's resume (a hook for tests and staged rollouts).
    """
    own = client is None
    if client is None:
        client = ProxyClient(proxies, admin_token=admin_token, timeout_s=timeout_s, max_retries=2, backoff_s=0.2)
    try:
        return _publish(client, str(model_path), int(version), before_resume)
    finally:
        if own:
            client.close()


def _publish(client: ProxyClient, model_path: str, version: int, before_resume: Callable[[str], None] | None) -> PublishReport:
    urls = list(client.urls)
    every = list(range(len(urls)))
    report = PublishReport(version=version, model_path=model_path, proxies=urls)
    lap = _Laps(report)

    def fail_first(step: str, results, engines_of: Callable[[int], Sequence[str]] = lambda i: ()) -> None:
        bad = [(i, exc) for i, _, exc in results if exc is not None]
        if bad:
            i, exc = bad[0]
            others = "; ".join(f"{urls[j]}: {_message(e)}" for j, e in bad[1:])
            msg = _message(exc) + (f" (also failed: {others})" if others else "")
            raise PublishError(step, urls[i], msg, report, engines=engines_of(i), cause=exc)

    # 1. what each proxy's engines are (nothing is paused yet). One proxy needs no plan: it loads
    #    all of its engines. A proxy whose status does not list its engines does the same.
    groups: dict[int, list[str] | None] = {}
    if len(urls) == 1:
        groups[0] = None
    else:
        results = _parallel(lambda i: client.status(i), every)
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
            results = _parallel(lambda i: client.admin(i, "/admin/pause"), every)
        else:
            results = _recompute_then_pause(client, every, urls, report)
        report.recomputed_tokens += sum(int((res or {}).get("recomputed_tokens") or 0) for _, res, exc in results if exc is None)
        fail_first("pause", results)
        lap("pause")

        # 3. each distinct engine loads the weights once, through one proxy
        def load(i: int) -> dict[str, Any]:
            body: dict[str, Any] = {"model_path": model_path, "version": version}
            if groups[i] is not None:
                body["engines"] = groups[i]
            return client.admin(i, "/admin/update_weights", body)

        results = _parallel(load, sorted(groups))
        for _, res, exc in results:
            if exc is None and isinstance(res, dict):
                report.loaded += list(res.get("loaded") or [])
                report.skipped += list(res.get("skipped") or [])
                report.stale += list(res.get("stale") or [])
        fail_first("load", results, engines_of=lambda i: groups.get(i) or [])
        lap("load")

        # 4. every other proxy learns the version (before any proxy resumes)
        rest = [i for i in every if i not in groups]
        results = _parallel(lambda i: client.admin(i, "/admin/version", {"version": version, "model_path": model_path}), rest)
        fail_first("version", results)
        lap("version")
    except BaseException:
        _resume_all(client, urls, every, None)  # none is left paused; the original error wins
        raise

    # 5. every proxy resumes
    _resume_and_time(client, urls, every, before_resume, report, lap)
    report.ok = True
    return report


class _Laps:
    """``lap(name)`` records the seconds since the previous lap in ``report.timings_s``."""

    def __init__(self, report: PublishReport):
        self.report = report
        self.start = self.clock = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.report.timings_s[name] = round(now - self.clock, 4)
        self.clock = now


def _resume_and_time(client: ProxyClient, urls: list[str], every: list[int], before: Callable[[str], None] | None,
                     report: PublishReport, lap: _Laps) -> None:
    """The last step of a publish: every proxy resumes; the first that could not is the error."""
    bad = _resume_all(client, urls, every, before)
    lap("resume")
    report.timings_s["total"] = round(time.perf_counter() - lap.start, 4)
    if bad:
        i, exc = bad[0]
        raise PublishError("resume", urls[i], _message(exc), report, cause=exc)


def _resume_all(client: ProxyClient, urls: list[str], every: list[int], before: Callable[[str], None] | None) -> list[tuple[int, BaseException]]:
    def resume(i: int) -> Any:
        if before is not None:
            before(urls[i])
        return client.admin(i, "/admin/resume")

    return [(i, exc) for i, _, exc in _parallel(resume, every) if exc is not None]


# -- weights over torch.distributed ----------------------------------------------------------


def publish_tensors(
    proxies: str | Sequence[str],
    named_tensors: Iterable[tuple[str, Any]],
    version: int,
    admin_token: str | None = None,
    *,
    sender: Any = None,
    bucket_mb: float | None = None,
    dtype: Any = None,
    master_address: str = "127.0.0.1",
    backend: str | None = None,
    client: ProxyClient | None = None,
    timeout_s: float = 600.0,
    before_resume: Callable[[str], None] | None = None,
) -> PublishReport:
    """The fleet protocol with the weights broadcast from this process (rank 0) instead of read
    from a path (docs/weight_transfer.md). Needs torch (``trainer_bridge.weight_transfer``).

    ``named_tensors``: ``(name, tensor)`` pairs in the engine's parameter names, produced lazily
    (``model.named_parameters()``, or an FSDP2 trainer's per-bucket ``full_tensor()`` gather);
    they are iterated exactly once, to the end, even when every engine failed (a sharded
    trainer's other ranks run the same gathers). ``sender``: a
    :class:`~trainer_bridge.weight_transfer.WeightSender` kept across publishes so each engine
    joins once (made here and closed at the end when None). ``bucket_mb``: tensors per update
    call; ``dtype``: cast to the engine's dtype (None: as given).

    Steps: status; owed recomputes then pause on every proxy; every proxy takes the engines
    about to change out of rotation; each engine (through one proxy) joins its group with rank 0
    unless it still holds one; per bucket, each engine's proxy issues the update call while this
    process broadcasts; every proxy learns the version and which engines completed; every proxy
    resumes. An engine whose transfer failed stays out of rotation (named in ``/admin/status``
    ``out_of_rotation``) until a later complete publish, the others go on, and
    :class:`PublishError` (step ``transfer``) names it after every proxy resumed. Engines that
    already report ``version`` are skipped.
    """
    from . import weight_transfer as wt

    own_sender = sender is None
    if sender is None:
        sender = wt.WeightSender(master_address=master_address, backend=backend, timeout_s=timeout_s)
    own = client is None
    if client is None:
        client = ProxyClient(proxies, admin_token=admin_token, timeout_s=timeout_s, max_retries=2, backoff_s=0.2)
    # transfer calls are never retried: a repeated join or bucket would wait for a broadcast that already went
    xfer = ProxyClient(client.urls, admin_token=admin_token or getattr(client, "admin_token", None), timeout_s=timeout_s, max_retries=0)
    it = iter(named_tensors)
    try:
        return _publish_tensors(client, xfer, sender, it, int(version), bucket_mb, dtype, before_resume)
    except BaseException:
        try:  # whatever failed, the tensors are read to the end: other ranks gather them too
            for _ in it:
                pass
        except Exception:  # noqa: BLE001 - the original error wins
            pass
        raise
    finally:
        if own_sender:
            sender.close(lambda link: _destroy_remote(xfer, link))
        xfer.close()
        if own:
            client.close()


def destroy_groups(sender: Any, client: ProxyClient) -> None:
    """Drop every group ``sender`` holds, telling each engine through its proxy (best effort)."""
    xfer = ProxyClient(client.urls, admin_token=getattr(client, "admin_token", None), timeout_s=30.0, max_retries=0)
    try:
        sender.close(lambda link: _destroy_remote(xfer, link))
    finally:
        xfer.close()


def _destroy_remote(xfer: ProxyClient, link: Any) -> None:
    i, _epoch = link.key
    xfer.admin(i, "/admin/weights/destroy_group", {"engine": link.engine, "group_name": link.group_name})


def _publish_tensors(client, xfer, sender, named_tensors, version, bucket_mb, dtype, before_resume) -> PublishReport:
    from . import weight_transfer as wt

    urls = list(client.urls)
    every = list(range(len(urls)))
    report = PublishReport(version=version, model_path="", proxies=urls, transfer="distributed")
    lap = _Laps(report)

    def fail_first(step: str, results) -> None:
        bad = [(i, exc) for i, _, exc in results if exc is not None]
        if bad:
            i, exc = bad[0]
            raise PublishError(step, urls[i], _message(exc), report, cause=exc)

    # 1. the engines, which proxy drives each, and what each reports
    results = _parallel(lambda i: client.status(i), every)
    fail_first("status", results)
    statuses = [res if isinstance(res, dict) else {} for _, res, _ in results]
    engines, assigned = plan_loads(statuses)
    if not engines:
        raise PublishError("status", urls[0], "no proxy lists its engines (engines.engine_replicas): the distributed transfer needs them", report)
    vllm = [urls[i] for i, st in enumerate(statuses) if (st.get("engines") or {}).get("kind") == "vllm"]
    if vllm:  # its workers join vLLM's own NCCL communicator, not this kind of group: they would wait forever
        raise PublishError("status", vllm[0], "vLLM engines receive weights only from vLLM's own NCCL communicator "
                           "(vllm.distributed.weight_transfer); publish to them from disk (--model-path)", report)
    report.engines = engines
    report.loaders = {e: urls[i] for e, i in assigned.items()}
    facts = {e: next(r for r in engine_replicas(statuses[assigned[e]]) if str(r["id"]) == e) for e in engines}
    todo = []
    for e in engines:
        f = facts[e]
        if f.get("weight_version") == version and not f.get("out_of_rotation") and f.get("healthy", True):
            report.skipped.append(e)
        else:  # one its proxy last saw down is tried too: it may be back (joining fails fast if not)
            todo.append(e)
    lap("status")

    groups_before = sender.groups_made
    try:
        # 2. owed recomputes on every proxy, then (only then) every proxy pauses
        results = _recompute_then_pause(client, every, urls, report)
        fail_first("pause", results)
        lap("pause")

        # 3. every proxy takes the engines about to change out of rotation (a transfer that
        #    stops half way then leaves none of them serving mixed weights)
        changing = todo + list(report.failed)
        results = _parallel(lambda i: client.admin(i, "/admin/weights/begin", {"version": version, "engines": changing}), every)
        fail_first("begin", results)

        # 4. each engine joins its group with rank 0 once (kept while the engine stays the same)
        links: dict[str, Any] = {}
        kept: set[str] = set()  # engines whose group was made by an earlier publish
        pool = ThreadPoolExecutor(max_workers=max(4, 2 * len(todo)))
        try:
            def connect(k: int) -> None:
                e = todo[k]
                i = assigned[e]
                key = (i, facts[e].get("epoch", 0))
                join = lambda body: pool.submit(xfer.admin, i, "/admin/weights/init_group", {**body, "engine": e})  # noqa: E731
                ranks = int((xfer.admin(i, "/admin/weights/ranks", {"engine": e}) or {}).get("ranks") or 1)
                links[e], made = sender.link(e, key, join, ranks=ranks)
                if not made:
                    kept.add(e)

            for k, _, exc in _parallel(connect, list(range(len(todo)))):
                if exc is not None:
                    report.failed[todo[k]] = f"joining the weight-update group failed: {_message(exc)}"
                    sender.drop(todo[k])
            report.groups_made = sender.groups_made - groups_before
            lap("connect")

            # 5. per bucket: each engine's proxy issues the update call while rank 0 broadcasts
            mb = wt.DEFAULT_BUCKET_MB if bucket_mb is None else float(bucket_mb)
            for bucket in wt.buckets(named_tensors, max(1, int(mb * 2**20)), dtype=dtype):
                report.buckets += 1
                active = [e for e in todo if e not in report.failed]
                if not active:
                    continue  # every engine failed: the rest is read (other ranks gather too), not sent
                report.bytes_sent += bucket.nbytes

                def send(k: int, bucket=bucket, active=active) -> None:
                    e = active[k]
                    body = {
                        "engine": e, "group_name": links[e].group_name, "version": version,
                        "names": bucket.names, "dtypes": bucket.dtypes, "shapes": bucket.shapes,
                        "first": bucket.first, "final": bucket.final,
                    }  # fmt: skip
                    call = pool.submit(xfer.admin, assigned[e], "/admin/weights/update", body)
                    try:
                        sender.send(links[e], bucket, call)
                        call.result(timeout=sender.timeout_s)
                    except Exception:
                        if not (bucket.first and e in kept):
                            raise
                        # a kept group that no longer works (the engine restarted between two
                        # health checks, so its proxy saw no change): make a new one, once
                        kept.discard(e)
                        old = sender.drop(e)
                        if old is not None:
                            try:
                                _destroy_remote(xfer, old)
                            except Exception:  # noqa: BLE001 - a restarted engine has no such group
                                pass
                        connect(todo.index(e))
                        report.groups_made = sender.groups_made - groups_before
                        body["group_name"] = links[e].group_name
                        call = pool.submit(xfer.admin, assigned[e], "/admin/weights/update", body)
                        sender.send(links[e], bucket, call)
                        call.result(timeout=sender.timeout_s)

                for k, _, exc in _parallel(send, list(range(len(active)))):
                    if exc is not None:
                        e = active[k]
                        report.failed[e] = f"bucket {report.buckets} failed: {_message(exc)}"
                        link = sender.drop(e)
                        if link is not None:
                            try:  # the engine may still hold its end of the group
                                _destroy_remote(xfer, link)
                            except Exception:  # noqa: BLE001
                                pass
            lap("transfer")
        finally:
            pool.shutdown(wait=False)
        report.loaded = [e for e in todo if e not in report.failed]

        # 6. every proxy learns the version and which engines have it whole
        body = {"version": version, "updated": report.loaded + report.skipped, "failed": report.failed}
        results = _parallel(lambda i: client.admin(i, "/admin/weights/commit", body), every)
        fail_first("version", results)
        lap("version")
    except BaseException:
        _resume_all(client, urls, every, None)  # none is left paused; the original error wins
        raise

    # 7. every proxy resumes
    _resume_and_time(client, urls, every, before_resume, report, lap)
    if report.failed:
        first = next(iter(report.failed))
        detail = "; ".join(f"{e}: {why}" for e, why in report.failed.items())
        raise PublishError(
            "transfer", report.loaders.get(first, urls[0]),
            f"{len(report.failed)} engine(s) did not get the whole weights and stay out of rotation ({detail}); "
            f"{len(report.loaded) + len(report.skipped)} engine(s) serve v{version}; retry, or publish from disk",
            report, engines=list(report.failed),
        )  # fmt: skip
    report.ok = True
    return report


# -- CLI ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="splice publish",
        description="Publish weights to a Splice fleet: pause every proxy, load each engine once, "
        "tell every proxy the version, resume every proxy.",
    )
    ap.add_argument("--proxy", action="append", default=[], metavar="URL", help="proxy base URL (repeatable)")
    ap.add_argument("--proxy-dns", action="append", default=[], metavar="NAME:PORT",
                    help="a DNS name whose address records are the proxies (repeatable), e.g. a headless Service")
    ap.add_argument("--model-path", help="disk transfer: the weights, as a path on the engines' filesystem")
    ap.add_argument("--transfer", choices=("disk", "distributed"), default=None,
                    help="disk: each engine loads --model-path; distributed: this process broadcasts --weights "
                    "to the engines over torch.distributed (needs torch; the engines are never told a path). "
                    "Default: distributed when --weights is given, else disk")
    ap.add_argument("--weights", metavar="DIR", help="distributed transfer: a safetensors directory on this machine")
    ap.add_argument("--bucket-mb", type=float, default=None, help="distributed: megabytes of tensors per update call (default 512)")
    ap.add_argument("--master-address", default="127.0.0.1",
                    help="distributed: the address the engines reach this process at (default 127.0.0.1)")
    ap.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                    help="distributed: torch.distributed backend (default: nccl with a GPU here, else gloo)")
    ap.add_argument("--dtype", default=None, help="distributed: cast tensors to this torch dtype first (e.g. bfloat16)")
    ap.add_argument("--version", required=True, type=int, help="the policy version these weights are")
    ap.add_argument("--admin-token", default=None, help="bearer token of the proxies' admin API (default: $SPLICE_ADMIN_TOKEN, else the token a splice serve on this machine generated, for loopback proxies)")
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    a = ap.parse_args(argv)
    import os

    token = a.admin_token or os.environ.get("SPLICE_ADMIN_TOKEN") or None
    try:
        proxies = resolve_proxies(list(a.proxy) + [f"dns://{d}" for d in a.proxy_dns])
    except (OSError, ValueError) as exc:
        print(f"splice publish: cannot resolve the proxies: {exc}", file=sys.stderr)
        return 2
    if not proxies:
        print("splice publish: give at least one --proxy URL or --proxy-dns NAME:PORT", file=sys.stderr)
        return 2
    transfer = a.transfer or ("distributed" if a.weights else "disk")
    if transfer == "disk" and not a.model_path:
        print("splice publish: the disk transfer needs --model-path (or use --transfer distributed --weights DIR)", file=sys.stderr)
        return 2
    if transfer == "distributed" and not a.weights:
        print("splice publish: the distributed transfer needs --weights DIR (safetensors on this machine)", file=sys.stderr)
        return 2
    try:
        if transfer == "disk":
            report = publish(proxies, a.model_path, a.version, token, timeout_s=a.timeout_s)
        else:
            try:
                import torch

                from .weight_transfer import safetensors_tensors
            except ImportError as exc:
                print(f"splice publish: the distributed transfer needs torch ({exc}); use --model-path for the disk transfer", file=sys.stderr)
                return 2
            dtype = getattr(torch, a.dtype, None) if a.dtype else None
            if a.dtype and not isinstance(dtype, torch.dtype):
                print(f"splice publish: unknown --dtype {a.dtype!r}", file=sys.stderr)
                return 2
            report = publish_tensors(
                proxies, safetensors_tensors(a.weights), a.version, token, bucket_mb=a.bucket_mb, dtype=dtype,
                master_address=a.master_address, backend=a.backend, timeout_s=a.timeout_s,
            )  # fmt: skip
    except PublishError as exc:
        if a.json:
            print(json.dumps(exc.report.to_dict(), indent=2))
        print(f"splice publish: {exc} (every proxy was resumed)", file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        t = report.timings_s
        how = f" by broadcast ({report.bytes_sent / 1e9:.2f} GB, {report.buckets} bucket(s))" if report.transfer == "distributed" else ""
        print(
            f"published v{report.version}{how} to {len(report.proxies)} proxies: {len(report.engines)} engine(s), "
            f"loaded {len(report.loaded)}, already at v{report.version} {len(report.skipped)}, unreachable {len(report.stale)} "
            f"| {t.get('total', 0):.2f}s (pause {t.get('pause', 0):.2f}s, load {t.get('load', 0):.2f}s, "
            f"resume {t.get('resume', 0):.2f}s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
