"""HTTP plumbing shared by the engine clients: one place maps transport trouble to typed errors.

Mapping (what the pool's failover relies on):

- connection refused / reset / protocol errors -> ``EngineUnavailable`` (the replica is down)
- any httpx timeout                            -> ``EngineTimeout``
- HTTP 5xx, or a body that is not JSON          -> ``EngineBadResponse``
- HTTP 4xx                                      -> ``EngineRejected`` (never retried)
- no complete reply within the call's deadline  -> ``EngineTimeout``

Every call has a *total* deadline, not only a per-read timeout: an engine that drips a byte a
second would otherwise never time out. A plain request's rides on its connection's read timer
(``EngineTransport.open(total_s=...)``); a stream's is ``deadline`` around its whole reading.

Engines can emit ``-Infinity``/``NaN`` in JSON (Python's encoder does); those bodies are
decoded leniently and every non-finite or null logprob is mapped to ``NEG_INF_LOGPROB``.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import os
import urllib.parse
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import httpx
import numpy as np
import orjson

from engines.http_transport import EngineTransport, Reply
from engines.json_body import Content, encode_body
from engines.types import (
    EngineBadResponse,
    EngineError,
    EngineRejected,
    EngineTimeout,
    EngineUnavailable,
)

# vLLM clamps -inf to -9999.0 on the wire; Splice uses the same value for every engine so a
# zero-probability token looks the same whichever engine sampled or scored it.
NEG_INF_LOGPROB = -9999.0

_ERROR_SNIPPET = 500
# A replica that does not accept a connection within this long is treated as down (failover),
# however long generation itself may take.
CONNECT_TIMEOUT_S = 10.0


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (``http://user:***@host``), for messages.

    The user name stays so an operator can tell replicas apart; the secret never reaches a log
    line, an exception or ``/admin/status``.
    """
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return url
    if parts.password is None and "@" not in parts.netloc:
        return url
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user = userinfo.split(":", 1)[0]
    netloc = f"{user}:***@{hostport}" if ":" in userinfo else (f"{user}@{hostport}" if user else hostport)
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


class deadline:
    """The whole body of the ``async with`` must finish within ``total_s`` seconds, else
    ``EngineTimeout`` (the work inside is cancelled, which closes its connection). A plain class
    rather than a generator-based context manager: every engine call enters one."""

    __slots__ = ("_total_s", "_replica", "_path", "_timeout")

    def __init__(self, total_s: float, replica: str, path: str = ""):
        self._total_s, self._replica, self._path = total_s, replica, path
        self._timeout = asyncio.timeout(total_s)

    async def __aenter__(self) -> None:
        await self._timeout.__aenter__()

    async def __aexit__(self, exc_type, exc, tb) -> bool | None:
        try:
            return await self._timeout.__aexit__(exc_type, exc, tb)
        except TimeoutError:
            raise EngineTimeout(f"{self._replica}{self._path}: no complete reply within {self._total_s:g} s",
                                replica=self._replica) from None


def split_credentials(url: str) -> tuple[str, tuple[str, str] | None]:
    """``(url without user:password@, (user, password) or None)``: requests carry the
    credentials in a basic-auth header, so a logged request URL never contains them."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return url, None
    if "@" not in parts.netloc:
        return url, None
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    bare = urllib.parse.urlunsplit((parts.scheme, hostport, parts.path, parts.query, parts.fragment))
    return bare, (urllib.parse.unquote(user), urllib.parse.unquote(password))


def basic_auth(user: str, password: str) -> str:
    """The ``Authorization`` value for HTTP basic auth (UTF-8, as httpx and curl send it)."""
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode("ascii")


def token_list(ids) -> Any:
    """Token ids as a request body takes them, with no per-token copy (a long session's prompt
    is 100k of them): a list of ints or a numpy integer array is sent as it is (orjson writes
    arrays natively, ``OPT_SERIALIZE_NUMPY``); anything else becomes a list of ints."""
    if type(ids) is list or (isinstance(ids, np.ndarray) and ids.ndim == 1 and ids.dtype.kind == "i"):
        return ids
    return [int(t) for t in ids]


def id_list(ids) -> list[int]:
    """Token ids as a list of Python ints (``tolist`` for a numpy array: one C pass)."""
    return ids.tolist() if isinstance(ids, np.ndarray) else list(ids)


def clean_logprob(value: Any) -> float:
    """A finite float for a logprob from the wire (-inf, NaN and null -> NEG_INF_LOGPROB)."""
    if value is None:
        return NEG_INF_LOGPROB
    x = float(value)
    if math.isnan(x) or x < NEG_INF_LOGPROB:
        return NEG_INF_LOGPROB
    return x


# Below this many values a list comprehension is cheaper than numpy's fixed cost per call.
VECTOR_MIN = 32


def clean_logprobs(values: list) -> list[float]:
    """``clean_logprob`` of each value, in one numpy pass for a long list (a reply of a thousand
    tokens, a prefill of 100k): the per-value Python calls were a fifth of a long turn's CPU.
    ``float64`` holds every wire float exactly; ``None`` becomes NaN and then the floor."""
    if len(values) < VECTOR_MIN:
        return [clean_logprob(v) for v in values]
    try:
        a = np.array(values, dtype=np.float64)
    except (TypeError, ValueError, OverflowError):
        return [clean_logprob(v) for v in values]  # raises for the bad value as it always did
    if a.ndim != 1:
        return [clean_logprob(v) for v in values]
    bad = np.isnan(a) | (a < NEG_INF_LOGPROB)
    if bad.any():
        a[bad] = NEG_INF_LOGPROB
    return a.tolist()


def vocab_bound(tokenizer) -> int:
    """How many token ids the served model can sample: the tokenizer's ids, or the model's
    (padded) embedding rows when its ``config.json`` sits next to the tokenizer; ids in between
    decode to nothing but are the model's own."""
    n = len(tokenizer)
    path = getattr(tokenizer, "name_or_path", None)
    if path and os.path.isfile(os.path.join(str(path), "config.json")):
        try:
            with open(os.path.join(str(path), "config.json"), "rb") as f:
                cfg = orjson.loads(f.read())
            v = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
            if isinstance(v, int) and not isinstance(v, bool) and v > n:
                return v
        except (OSError, ValueError, AttributeError):
            pass
    return n


def check_token_ids(ids: list[int], vocab_size: int | None, replica: str = "") -> None:
    """Raise ``EngineBadResponse`` unless every id is a token of the tokenizer (``0 <= id < vocab_size``).

    An id outside the vocabulary cannot be decoded, stored (int32) or trained on: the engine
    and the proxy disagree about the model, which is the engine's error to report (502)."""
    if not ids or not vocab_size:
        return
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise EngineBadResponse(
            f"{replica or 'engine'}: sampled token id {bad} is outside the model's vocabulary (0..{vocab_size - 1}); "
            "is the engine serving the model the proxy's tokenizer belongs to?",
            replica=replica,
            retryable=False,
        )


def map_transport_error(exc: httpx.HTTPError, replica: str) -> EngineError:
    """Turn an httpx exception into the engine error the pool understands."""
    if isinstance(exc, httpx.TimeoutException):
        why = f": {exc}" if str(exc) else ""
        return EngineTimeout(f"{replica}: timed out ({type(exc).__name__}{why})", replica=replica)
    if isinstance(exc, (httpx.TransportError,)):
        return EngineUnavailable(f"{replica}: {type(exc).__name__}: {exc}", replica=replica)
    return EngineBadResponse(f"{replica}: {type(exc).__name__}: {exc}", replica=replica)


def status_error(status: int, body: bytes, replica: str, path: str) -> EngineError:
    """The error for a non-2xx reply; the engine's own message is kept for the operator."""
    text = body[:_ERROR_SNIPPET].decode("utf-8", "replace")
    msg = f"{replica}{path}: HTTP {status}: {text}"
    if 400 <= status < 500:
        return EngineRejected(msg, replica=replica)
    return EngineBadResponse(msg, replica=replica)


def decode_json(body: bytes, replica: str, path: str) -> Any:
    """Parse a JSON body; tolerate ``-Infinity``/``NaN`` literals; malformed -> EngineBadResponse."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        snippet = body[:200].decode("utf-8", "replace")
        raise EngineBadResponse(f"{replica}{path}: malformed JSON ({exc}): {snippet!r}", replica=replica) from None


def expect_dict(data: Any, replica: str, path: str) -> dict:
    if not isinstance(data, dict):
        raise EngineBadResponse(f"{replica}{path}: expected a JSON object, got {type(data).__name__}", replica=replica)
    return data


class Http:
    """A replica's base URL on the shared client's engine transport (engines/http_transport.py);
    every call raises typed errors."""

    def __init__(self, client: httpx.AsyncClient, base_url: str):
        # ``user:pass@`` in the URL becomes a basic-auth header on every request, and requests go
        # to the URL without it (httpx logs request URLs); every message, error and status shows
        # ``url``, where the password is redacted.
        self._base, creds = split_credentials(base_url.rstrip("/"))
        self.url = redact_url(base_url.rstrip("/"))
        # Every call goes out on the transport's direct path (engines/http_transport.py).
        transport = getattr(client, "_transport", None)
        if not isinstance(transport, EngineTransport):
            raise TypeError("engine clients need an httpx.AsyncClient(transport=engines.http_transport.EngineTransport())")
        self._direct = transport
        self._auth_headers = {"authorization": basic_auth(*creds)} if creds else {}

    async def request(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        timeout: float,
        allow_empty: bool = False,
        headers: dict[str, str] | None = None,
        idempotent: bool = False,
    ) -> Any:
        """Send one request and return its decoded JSON body (None for an allowed empty body).

        ``idempotent``: the call may run twice (pause, resume), so a connection that died before
        the answer (the engine closed it as the request went out, or reset it) is retried once,
        on a new connection. Other calls are not: the pool decides whether a generation may run
        again."""
        content = encode_body(body) if body is not None else None
        headers = dict(headers or {})
        if content is not None:
            headers["content-type"] = "application/json"
        for attempt in range(2 if idempotent else 1):
            try:  # the total deadline rides on the connection's read timer (engines/http_transport.py)
                reply = await self._open(method, path, content, headers, timeout, total=True)
                try:
                    status, data = reply.status, await reply.read()
                finally:
                    reply.close()
                break
            except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
                if attempt == 0 and idempotent:
                    continue
                raise map_transport_error(exc, self.url) from exc
            except httpx.HTTPError as exc:
                raise map_transport_error(exc, self.url) from exc
        if status >= 300:
            raise status_error(status, data, self.url, path)
        if allow_empty and not data.strip():
            return None
        return decode_json(data, self.url, path)

    def _open(self, method: str, path: str, content: Content | None, headers: dict[str, str], timeout: float, *,
              total: bool = False):  # fmt: skip
        if self._auth_headers:
            headers.update(self._auth_headers)
        return self._direct.open(
            method, self._base + path, content=content, headers=headers, connect_s=min(timeout, CONNECT_TIMEOUT_S), read_s=timeout,
            total_s=timeout if total else None,
        )  # fmt: skip

    async def probe(self, method: str, path: str, *, timeout: float = 10.0) -> int | None:
        """The HTTP status ``method path`` answers with, or None when the replica is unreachable.

        Used at start-up to learn which endpoints exist without calling them: ``GET`` on a
        POST-only route answers 405 where the route exists and 404 where it does not.
        """
        try:
            async with deadline(timeout, self.url, path):
                reply = await self._open(method, path, None, {}, timeout)
        except (httpx.HTTPError, EngineTimeout):
            return None
        reply.close()
        return reply.status

    @asynccontextmanager
    async def stream(
        self, path: str, body: Any, *, timeout: float, headers: dict[str, str] | None = None
    ) -> AsyncIterator[Reply]:
        """POST and yield the open reply once its status is known to be 2xx (read it with ``sse``)."""
        content = encode_body(body)
        headers = {**(headers or {}), "content-type": "application/json", "accept": "text/event-stream"}
        try:
            reply = await self._open("POST", path, content, headers, timeout)
        except httpx.HTTPError as exc:
            raise map_transport_error(exc, self.url) from exc
        try:
            if reply.status >= 300:
                try:
                    content = await reply.read()
                except httpx.HTTPError:
                    content = b""
                raise status_error(reply.status, content, self.url, path)
            yield reply
        finally:
            reply.close()

    async def sse(self, resp: Reply, path: str) -> AsyncIterator[dict]:
        """Yield each ``data: {...}`` frame of a server-sent-event stream until ``data: [DONE]``.

        A frame carrying ``error`` (how SGLang and vLLM report failures mid-stream) raises.
        """
        try:
            async for line in resp.lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue  # blank separators, comments, event names
                payload = line[5:].strip()
                if payload == "[DONE]":
                    return
                frame = expect_dict(decode_json(payload.encode(), self.url, path), self.url, path)
                raise_stream_error(frame, self.url, path)
                yield frame
        except httpx.HTTPError as exc:
            raise map_transport_error(exc, self.url) from exc


def raise_stream_error(frame: dict, replica: str, path: str) -> None:
    """Raise if an SSE frame is an error report rather than data."""
    err = frame.get("error")
    if err is None and frame.get("object") == "error":
        err = frame
    if err is None:
        return
    message = err.get("message", err) if isinstance(err, dict) else err
    code = err.get("code") if isinstance(err, dict) else None
    if isinstance(code, int) and 400 <= code < 500:
        raise EngineRejected(f"{replica}{path}: {message}", replica=replica)
    raise EngineBadResponse(f"{replica}{path}: error in stream: {message}", replica=replica)


def weight_version_spans(raw: Any) -> tuple[tuple[int, int, str], ...]:
    """``weight_versions`` as both engines report them (SGLang >= 0.5.23 ``meta_info``, vLLM's
    ``WeightVersionSpan``: version, start, end) as (start, end, version); () when absent or malformed."""
    if not isinstance(raw, list):
        return ()
    try:
        return tuple((int(s["start"]), int(s["end"]), str(s["version"])) for s in raw)
    except (KeyError, TypeError, ValueError):
        return ()
