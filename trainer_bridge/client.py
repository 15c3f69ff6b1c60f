"""HTTP client for the proxy's trainer side: pull/ack samples and the weight-update protocol.

This is the trainer's only link to the proxy (docs/design.md sections 1 and 7). One client can drive
several proxies (a fleet, docs/fleet.md): samples are pulled from all of them, round-robin, groups
whole; ``publish`` runs the fleet weight-update protocol (``trainer_bridge.publish``). A proxy URL
of the form ``dns://NAME:PORT`` stands for every address the name resolves to (a Kubernetes
headless Service), resolved when the client is made.

Transient trouble (connection errors, 429, 5xx) is retried with exponential backoff, honouring
``Retry-After``. Anything else the proxy reports comes back as :class:`ProxyError`, carrying
the message of the proxy's OpenAI-shaped error body.
"""

from __future__ import annotations

import email.utils
import socket
import time
import urllib.parse
import uuid
from collections.abc import Sequence
from typing import Any

import httpx

RETRY_STATUS = frozenset({429, 500, 502, 503, 504})


class ProxyError(RuntimeError):
    """The proxy answered with an error (after retries, when the error was transient)."""

    def __init__(self, message: str, *, status: int | None = None, type: str | None = None, code: str | None = None, url: str = ""):
        where = f" ({url})" if url else ""
        super().__init__(f"{message}{where}" if status is None else f"HTTP {status}: {message}{where}")
        self.message = message
        self.status = status
        self.type = type
        self.code = code
        self.url = url


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
    ):
        self.urls = resolve_proxies(urls)
        if not self.urls:
            raise ValueError("at least one proxy URL is required")
        self.admin_token = admin_token
        self.last_statuses: list[dict[str, Any]] | None = None
        headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self._http = httpx.Client(headers=headers, timeout=timeout_s, transport=transport)
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._leases: dict[str, list[tuple[int, str]]] = {}  # our lease id -> (proxy index, its lease id)
        self._next = 0  # round-robin start for pulls

    # -- plumbing -------------------------------------------------------------------------------

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "ProxyClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, index: int, method: str, path: str, body: dict[str, Any] | None = None, timeout_s: float | None = None) -> Any:
        url = self.urls[index].rstrip("/") + path
        kwargs: dict[str, Any] = {} if body is None else {"json": body}
        if timeout_s is not None:
            kwargs["timeout"] = timeout_s
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
        reply = self._request(index, "POST", "/v1/trajectories/pull", body, timeout_s=None if timeout is None else timeout + wait_s)
        samples = list(reply.get("samples") or [])
        lease = reply.get("lease_id")
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

    def publish(self, model_path: str, version: int, **kw: Any) -> Any:
        """The fleet weight-update protocol (``trainer_bridge.publish``): every proxy pauses, each
        distinct engine loads ``model_path`` once, every proxy learns ``version``, every proxy
        resumes. A failure at any step resumes every proxy and raises ``PublishError`` (a
        ``ProxyError`` carrying the failed proxy's message). Returns the ``PublishReport``."""
        from .publish import publish

        return publish(self.urls, model_path, version, client=self, **kw)
