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

Talks to the proxies over HTTP only (``trainer_bridge`` never imports the proxy). The steps and
the report live in ``trainer_bridge.fleet``; the distributed transfer in ``weight_transfer``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from .client import ProxyClient, resolve_proxies
from .fleet import PublishError, PublishReport, engine_replicas, plan_loads, run_publish

# The distributed transfer needs torch: its entry points load on first use, so ``splice publish``
# from disk runs where torch is not installed (the sidecar image).
_LAZY = {"publish_tensors": "weight_transfer", "destroy_groups": "weight_transfer"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __package__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["PublishError", "PublishReport", "destroy_groups", "engine_replicas", "main", "plan_loads", "publish", "publish_tensors"]


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
        return run_publish(client, str(model_path), int(version), before_resume)
    finally:
        if own:
            client.close()


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

                from .weight_transfer import publish_tensors, safetensors_tensors
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
