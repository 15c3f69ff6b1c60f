"""HTTP client for the proxy's trainer side: pull/ack samples and the weight-update protocol.

This is the trainer's only link to the proxy (docs/design.md sections 1 and 7). One client can drive
several proxies (a fleet, docs/fleet.md): samples are pulled from all of them, round-robin, groups
whole; ``publish`` runs the fleet weight-update protocol (``trainer_bridge.publish``). A proxy URL
of the form ``dns://NAME:PORT`` stands for every address the name resolves to (a Kubernetes
headless Service), resolved when the client is made.

Samples are pulled as an Apache Arrow IPC stream (``Accept: application/vnd.apache.arrow.stream``;
docs/samples.md) and handed to the trainer as dicts of NumPy arrays (int32 ids and versions,
float32 logprobs, uint8 mask); a proxy that answers JSON is read too. Either way the sample
schema version must be the one this trainer reads (``SCHEMA_VERSION``), else
:class:`SchemaVersionError`.

Transient trouble (connection errors, 429, 5xx) is retried with exponential backoff, honouring
``Retry-After``. Anything else the proxy reports comes back as :class:`ProxyError`, carrying
the message of the proxy's OpenAI-shaped error body.
"""

from __future__ import annotations

import email.utils
import ipaddress
import os
import socket
import stat
import time
import urllib.parse
import uuid
from collections.abc import Sequence
from typing import Any

import httpx
import numpy as np
import pyarrow as pa

from .errors import ProxyError
from .fleet import PublishReport, run_publish

RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
SCHEMA_VERSION = 3  # the sample schema this trainer reads (proxy/schemas/sample.schema.json)
ARROW_STREAM = "application/vnd.apache.arrow.stream"
TOKEN_ARRAYS = ("input_ids", "loss_mask", "logprobs", "versions", "proximal_logprobs_t", "proximal_versions")


class SchemaVersionError(ProxyError):
    """The proxy sent samples in a schema version this trainer does not read."""


def check_schema_version(version: Any, url: str = "") -> None:
    """Refuse samples whose ``schema_version`` is not ``SCHEMA_VERSION`` (missing: older than 1)."""
    if version is not None and str(version) == str(SCHEMA_VERSION):
        return
    if version is None:
        why = "without a schema_version (a proxy older than sample schema 1); upgrade the proxy"
    else:
        try:
            newer = int(version) > SCHEMA_VERSION
        except (TypeError, ValueError):
            newer = False
        why = f"in sample schema version {version!r}; " + ("upgrade the trainer" if newer else "upgrade the proxy")
    raise SchemaVersionError(
        f"the proxy sent samples {why}: this trainer reads sample schema version {SCHEMA_VERSION} only "
        "(docs/samples.md). The lease was not acked; its samples return to the pool when it times out.",
        code="unsupported_schema_version", url=url,
    )


def read_arrow_samples(data: bytes, url: str = "") -> tuple[dict[str, str], list[dict[str, Any]]]:
    """An Arrow IPC stream of samples -> (``splice.*`` metadata without the prefix, samples).

    Each sample is a dict with the JSON sample's keys; per-token arrays are writable NumPy
    arrays (int32 ids and versions, float32 logprobs, uint8 mask). The schema version is
    checked before any record batch is read.
    """
    reader = pa.ipc.open_stream(data, options=pa.ipc.IpcReadOptions(use_threads=False))
    meta = {k.decode(): v.decode() for k, v in (reader.schema.metadata or {}).items()}
    meta = {k.removeprefix("splice."): v for k, v in meta.items() if k.startswith("splice.")}
    check_schema_version(meta.get("schema_version"), url)
    samples: list[dict[str, Any]] = []
    for batch in reader:
        rows: list[dict[str, Any]] = [{} for _ in range(batch.num_rows)]
        for name, column in zip(batch.schema.names, batch.columns):
            if name in TOKEN_ARRAYS:
                offsets, flat = _list_arrays(column)
                for i, row in enumerate(rows):
                    row[name] = flat[offsets[i] : offsets[i + 1]]
            else:
                for row, value in zip(rows, column.to_pylist()):
                    row[name] = value
        samples.extend(rows)
    return meta, samples


_NUMPY = {pa.int32(): np.dtype("<i4"), pa.float32(): np.dtype("<f4"), pa.uint8(): np.dtype("u1")}


def _list_arrays(column: pa.ListArray) -> tuple[np.ndarray, np.ndarray]:
    """(offsets from 0, one writable copy of the values) of a list column, read from its buffers."""
    dtype = _NUMPY.get(column.type.value_type)
    if dtype is None or column.null_count or column.values.null_count:
        offsets = column.offsets.to_numpy()
        return offsets - offsets[0], np.array(column.flatten().to_numpy(zero_copy_only=False))
    bufs = column.buffers()  # [validity, offsets, child validity, child values]
    offsets = np.frombuffer(bufs[1], np.int32, count=len(column) + 1, offset=4 * column.offset)
    start = column.values.offset + int(offsets[0])
    flat = np.frombuffer(bufs[3], dtype, count=int(offsets[-1] - offsets[0]), offset=dtype.itemsize * start).copy()
    return offsets - offsets[0], flat


def resolve_dns(name_port: str, *, scheme: str = "http") -> list[str]:
    """``NAME:PORT`` -> ``["http://ADDR:PORT", ...]``, one per distinct address record, sorted."""
    name, sep, port = name_port.rpartition(":")
    if not sep or not name or not port.isdigit():
        raise ValueError(f"expected NAME:PORT, got {name_port!r}")
    infos = socket.getaddrinfo(name, int(port), type=socket.SOCK_STREAM)
    addrs = sorted({info[4][0] for info in infos})
    return [f"{scheme}://{'[' + a + ']' if ':' in a else a}:{port}" for a in addrs]


def resolve_proxies(urls: str | Sequence[str]) -> list[str]:
    """Proxy URLs with every ``dns://NAME:PORT`` (or ``dns+https://NAME:PORT``) expanded to the
    addresses the name resolves to; duplicates dropped, order kept."""
    out: list[str] = []
    for url in [urls] if isinstance(urls, str) else list(urls):
        url = str(url).strip()
        parts = urllib.parse.urlsplit(url)
        if parts.scheme in ("dns", "dns+http", "dns+https"):
            scheme = "https" if parts.scheme == "dns+https" else "http"
            found = resolve_dns(parts.netloc, scheme=scheme)
            if not found:
                raise ValueError(f"{url}: the name has no address records")
            out.extend(found)
        else:
            out.append(url.rstrip("/"))
    return list(dict.fromkeys(out))


def admin_token_file() -> str:
    """Where ``splice serve`` keeps the admin token it generated when given none:
    ``$SPLICE_HOME/admin_token`` (default ``~/.cache/splice/admin_token``; proxy/auth.py writes it)."""
    home = os.environ.get("SPLICE_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "splice")
    return os.path.join(home, "admin_token")


def _loopback(url: str) -> bool:
    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def discover_admin_token(urls: Sequence[str]) -> str | None:
    """The admin token to send when none was given: ``$SPLICE_ADMIN_TOKEN``, else, when every
    proxy is on this machine (loopback), the token a local ``splice serve`` generated. The file
    is never sent to a proxy elsewhere (it is this machine's credential, not theirs), and one
    that other users could read is ignored, as ``splice serve`` refuses it."""
    token = os.environ.get("SPLICE_ADMIN_TOKEN")
    if token:
        return token
    if not urls or not all(_loopback(u) for u in urls):
        return None
    path = admin_token_file()
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o077:
            return None
        return os.read(fd, 4096).decode("utf-8", "replace").strip() or None
    finally:
        os.close(fd)


def _retry_after_s(response: httpx.Response) -> float | None:
    """``Retry-After`` as seconds (numeric or HTTP-date form), if present."""
    value = response.headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _error_from(response: httpx.Response) -> ProxyError:
    try:
        err = response.json().get("error")
    except Exception:
        err = None
    if isinstance(err, dict):
        return ProxyError(
            str(err.get("message") or response.reason_phrase),
            status=response.status_code,
            type=err.get("type"),
            code=err.get("code"),
            url=str(response.request.url),
        )
    text = response.text.strip()[:500] or response.reason_phrase
    return ProxyError(text, status=response.status_code, url=str(response.request.url))


class ProxyClient:
    """Sync client for one or more Splice proxies."""

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        admin_token: str | None = None,
        timeout_s: float = 600.0,
        max_retries: int = 6,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        transport: httpx.BaseTransport | None = None,
        arrow: bool = True,
    ):
        self.urls = resolve_proxies(urls)
        if not self.urls:
            raise ValueError("at least one proxy URL is required")
        if admin_token is None:  # $SPLICE_ADMIN_TOKEN, or a local proxy's generated token
            admin_token = discover_admin_token(self.urls)
        self.admin_token = admin_token
        self.last_statuses: list[dict[str, Any]] | None = None
        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self._http = httpx.Client(headers=headers, timeout=timeout_s, transport=transport)
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._leases: dict[str, list[tuple[int, str]]] = {}  # our lease id -> (proxy index, its lease id)
        self._next = 0  # round-robin start for pulls
        self.arrow = arrow  # ask for Arrow samples (JSON answers are read too)
        self.last_pull: dict[str, Any] = {}  # response-level fields of the last pull (schema_version, dropped_stale, ...)

    # -- plumbing -------------------------------------------------------------------------------

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "ProxyClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, index: int, method: str, path: str, body: dict[str, Any] | None = None, timeout_s: float | None = None,
                 *, accept: str | None = None, raw: bool = False) -> Any:
        """JSON of the answer (``raw``: the ``httpx.Response`` itself), after retries."""
        url = self.urls[index].rstrip("/") + path
        kwargs: dict[str, Any] = {} if body is None else {"json": body}
        if timeout_s is not None:
            kwargs["timeout"] = timeout_s
        if accept is not None:
            kwargs["headers"] = {"Accept": accept}
        for attempt in range(self.max_retries + 1):
            last = attempt == self.max_retries
            delay = min(self.max_backoff_s, self.backoff_s * 2**attempt)
            try:
                response = self._http.request(method, url, **kwargs)
            except httpx.TransportError as e:
                if last:
                    raise ProxyError(f"cannot reach proxy: {e!r}", url=url) from e
                time.sleep(delay)
                continue
            if response.status_code in RETRY_STATUS and not last:
                after = _retry_after_s(response)
                time.sleep(min(self.max_backoff_s, after) if after is not None else delay)
                continue
            if response.is_error:
                raise _error_from(response)
            if raw:
                return response
            return response.json() if response.content else {}
        raise AssertionError("unreachable")

    def admin(self, index: int, path: str, body: dict[str, Any] | None = None) -> Any:
        """``POST path`` on one proxy (by index into ``urls``)."""
        return self._request(index, "POST", path, {} if body is None else body)

    def _broadcast(self, method: str, path: str, body: dict[str, Any] | None = None) -> list[Any]:
        return [self._request(i, method, path, body) for i in range(len(self.urls))]

    # -- samples --------------------------------------------------------------------------------

    def pull(self, max_samples: int, wait_s: float = 0.0) -> tuple[str | None, list[dict[str, Any]]]:
        """Lease up to ``max_samples`` samples, waiting up to ``wait_s`` for some to be ready.

        Returns ``(lease_id, samples)``; ``lease_id`` is None when nothing was leased. With several
        proxies the lease id is this client's own handle for the proxies' leases.
        """
        if len(self.urls) == 1:
            return self._pull_one(0, max_samples, wait_s)
        deadline = time.monotonic() + wait_s
        got: list[dict[str, Any]] = []
        leases: list[tuple[int, str]] = []
        first = True
        while len(got) < max_samples:
            n = len(self.urls)
            start, self._next = self._next, (self._next + 1) % n
            for k in range(n):
                i = (start + k) % n
                remaining = deadline - time.monotonic()
                # first sweep never blocks; afterwards block briefly on one proxy at a time
                wait = 0.0 if first or got else max(0.0, min(1.0, remaining))
                lease, samples = self._pull_one(i, max_samples - len(got), wait)
                if lease is not None:
                    leases.append((i, lease))
                got.extend(samples)
                if len(got) >= max_samples:
                    break
            first = False
            if got or time.monotonic() >= deadline:
                break
        if not leases:
            return None, got
        lease_id = f"multi-{uuid.uuid4().hex}"
        self._leases[lease_id] = leases
        return lease_id, got

    def _pull_one(self, index: int, max_samples: int, wait_s: float) -> tuple[str | None, list[dict[str, Any]]]:
        body = {"max_samples": int(max_samples), "wait_s": float(wait_s)}
        timeout = self._http.timeout.read
        accept = f"{ARROW_STREAM}, application/json;q=0.5" if self.arrow else "application/json"
        response = self._request(index, "POST", "/v1/trajectories/pull", body, timeout_s=None if timeout is None else timeout + wait_s,
                                 accept=accept, raw=True)  # fmt: skip
        url = str(response.request.url)
        if response.headers.get("content-type", "").split(";")[0].strip() == ARROW_STREAM:
            try:
                meta, samples = read_arrow_samples(response.content, url)
            except (pa.ArrowException, OSError) as exc:  # cut off mid-stream: the lease times out, nothing is lost
                raise ProxyError(f"the proxy's Arrow answer is not a complete stream ({exc})", url=url) from exc
            lease = meta.get("lease_id")
            self.last_pull = {k: int(v) if v.isdigit() else v for k, v in meta.items() if k != "lease_id"}
        else:
            reply = response.json()
            check_schema_version(reply.get("schema_version"), url)
            samples = list(reply.get("samples") or [])
            lease = reply.get("lease_id")
            self.last_pull = {k: v for k, v in reply.items() if k not in ("samples", "lease_id")}
        if not samples and lease is not None:
            self._request(index, "POST", "/v1/trajectories/ack", {"lease_id": lease})  # nothing to hold on to
            lease = None
        return lease, samples

    def ack(self, lease_id: str | None) -> None:
        """Tell the proxy the leased samples were trained on; they will not come back."""
        if lease_id is None:
            return
        for index, lease in self._leases.pop(lease_id, [(0, lease_id)]):
            self._request(index, "POST", "/v1/trajectories/ack", {"lease_id": lease})

    # -- images -----------------------------------------------------------------------------------

    def image_bytes(self, image_hash: str) -> bytes:
        """The stored bytes of one image (``GET /v1/images/{hash}``, admin token), from the first
        proxy that has it: a fleet's proxies each store the images of the sessions they served."""
        quoted = urllib.parse.quote(str(image_hash), safe="")
        missing: ProxyError | None = None
        for index in range(len(self.urls)):
            try:
                return self._request(index, "GET", f"/v1/images/{quoted}", raw=True).content
            except ProxyError as e:
                if e.status != 404:
                    raise
                missing = e
        assert missing is not None
        raise missing

    # -- weights and versions -------------------------------------------------------------------

    def pause(self) -> None:
        """Run owed proximal recomputes, then pause engines on every proxy."""
        self._broadcast("POST", "/admin/pause")

    def update_weights(self, model_path: str, version: int) -> None:
        """Have every proxy load ``model_path`` on its engines as policy ``version``."""
        self._broadcast("POST", "/admin/update_weights", {"model_path": str(model_path), "version": int(version)})

    def set_version(self, version: int) -> None:
        """Set the policy version on every proxy (weights moved by other means)."""
        self._broadcast("POST", "/admin/version", {"version": int(version)})

    def resume(self) -> None:
        self._broadcast("POST", "/admin/resume")

    def status(self, index: int = 0) -> dict[str, Any]:
        """``GET /admin/status`` of one proxy (includes ``version``)."""
        return self._request(index, "GET", "/admin/status")

    def statuses(self) -> list[dict[str, Any]]:
        self.last_statuses = self._broadcast("GET", "/admin/status")  # what the engines are: read again by the trainer
        return self.last_statuses

    def version(self) -> int:
        """The policy version the proxies serve (the highest, if they disagree)."""
        return max(int(s.get("version", 0)) for s in self.statuses())

    def publish(self, model_path: str, version: int, *, admin_token: str | None = None, timeout_s: float = 600.0,
                before_resume: Any = None) -> PublishReport:
        """The fleet weight-update protocol (``trainer_bridge.publish``): every proxy pauses, each
        distinct engine loads ``model_path`` once, every proxy learns ``version``, every proxy
        resumes. A failure at any step resumes every proxy and raises ``PublishError`` (a
        ``ProxyError`` carrying the failed proxy's message). Returns the ``PublishReport``.
        ``admin_token`` and ``timeout_s`` are this client's own (accepted as ``publish`` takes them)."""
        return run_publish(self, str(model_path), int(version), before_resume)
