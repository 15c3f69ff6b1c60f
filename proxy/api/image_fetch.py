"""Fetching image URLs (``--allow-image-urls``) without becoming a way into the proxy's network.

An agent names the URL, so the proxy must not fetch what only the proxy can reach: its own
``/admin`` routes, the engines' unauthenticated APIs, a cloud metadata service. Every TCP
connection the fetch makes (the first one and one per redirect, which httpx follows through the
same connection pool) goes through ``GuardedBackend.connect_tcp``: the host name is resolved
once, every address it resolves to must be public (not loopback, private, link-local, multicast,
unspecified, reserved or shared address space, IPv4-mapped forms included) or inside an
operator's ``--image-url-allow-net``, and the connection is made to that checked address (so a
name cannot resolve to a public address for the check and to a private one for the connect).
Environment proxies (``HTTP_PROXY``) are not used.

What an agent learns is uniform: any failure (refused address, closed port, HTTP status, timeout,
size, not an image) is the same message; the reason goes to the proxy's log at INFO.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Iterable
from typing import Any

import httpcore
import httpx

log = logging.getLogger("splice.images")

FETCH_FAILED = "the image URL could not be fetched as an image"
MAX_REDIRECTS = 5

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class RefusedAddress(httpcore.ConnectError):
    """The URL's host resolves to an address the proxy does not fetch from."""


def public_address(ip: Address) -> bool:
    """True for an address on the public internet; False for loopback, private (10/8, 172.16/12,
    192.168/16, fc00::/7), link-local (169.254/16, fe80::/10), multicast, unspecified, reserved,
    shared (100.64/10) and documentation ranges, and IPv4-mapped / 6to4 forms of them."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return public_address(ip.ipv4_mapped)
        if ip.sixtofour is not None and not public_address(ip.sixtofour):
            return False
    return ip.is_global and not ip.is_multicast


def address_allowed(ip: Address, allow: Iterable[Network] = ()) -> bool:
    return public_address(ip) or any(ip.version == net.version and ip in net for net in allow)


async def resolve_checked(host: str, port: int, allow: Iterable[Network] = (), *, resolver=None) -> list[str]:
    """The addresses ``host`` resolves to, all allowed; ``RefusedAddress`` otherwise (also when
    it resolves to nothing). ``resolver(host, port)`` -> addresses (default: the system's)."""
    allow = tuple(allow)
    try:
        literal = ipaddress.ip_address(host.strip("[]"))
        addrs = [str(literal)]
    except ValueError:
        if resolver is not None:
            addrs = list(await resolver(host, port))
        else:
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as exc:
                raise RefusedAddress(f"{host} does not resolve ({exc})") from None
            addrs = list(dict.fromkeys(info[4][0] for info in infos))
    if not addrs:
        raise RefusedAddress(f"{host} resolves to no address")
    for a in addrs:
        ip = ipaddress.ip_address(a.split("%", 1)[0])  # a scoped IPv6 address carries %iface
        if not address_allowed(ip, allow):
            raise RefusedAddress(f"{host} resolves to {ip}, which is not a public address")
    return addrs


class GuardedBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend with every TCP connect checked by ``resolve_checked`` first."""

    def __init__(self, allow: Iterable[Network] = (), resolver=None):
        self.allow = tuple(allow)
        self.resolver = resolver
        self.inner = httpcore.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                          socket_options: Any = None) -> httpcore.AsyncNetworkStream:  # fmt: skip
        addrs = await resolve_checked(host, port, self.allow, resolver=self.resolver)
        last: Exception | None = None
        for a in addrs:
            try:
                return await self.inner.connect_tcp(a, port, timeout=timeout, local_address=local_address, socket_options=socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                last = exc
        assert last is not None
        raise last

    async def connect_unix_socket(self, *a, **kw):  # pragma: no cover - never used for URLs
        raise RefusedAddress("unix sockets are not fetched")

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


def guarded_client(timeout_s: float, allow: Iterable[Network] = (), resolver=None) -> httpx.AsyncClient:
    """An httpx client whose every connection (redirects included) is checked; no env proxies."""
    transport = httpx.AsyncHTTPTransport(trust_env=False)
    transport._pool = httpcore.AsyncConnectionPool(  # the one pool httpx would build, on the guarded backend
        ssl_context=httpx.create_ssl_context(), max_connections=16, network_backend=GuardedBackend(allow, resolver)
    )
    return httpx.AsyncClient(transport=transport, timeout=timeout_s, follow_redirects=True, max_redirects=MAX_REDIRECTS, trust_env=False)


def parse_nets(values: Iterable[str]) -> tuple[Network, ...]:
    """``--image-url-allow-net`` values (CIDR or single addresses) -> networks; ValueError names a bad one."""
    out = []
    for v in values:
        try:
            out.append(ipaddress.ip_network(v.strip(), strict=False))
        except ValueError:
            raise ValueError(f"--image-url-allow-net: {v!r} is not an address or CIDR network") from None
    return tuple(out)


async def fetch_bytes(client: httpx.AsyncClient, url: str, max_bytes: int, timeout_s: float) -> bytes | None:
    """The body of a 200 answer to GET ``url`` (at most ``max_bytes``); None, with the reason
    logged at INFO, for anything else."""

    async def get() -> bytes | None:
        async with client.stream("GET", url) as resp:
            if resp.status_code != 200:
                log.info("image URL %s: HTTP %d", url[:200], resp.status_code)
                return None
            declared = resp.headers.get("content-length")
            if declared and declared.isdigit() and int(declared) > max_bytes:
                log.info("image URL %s: %s bytes declared, above %d", url[:200], declared, max_bytes)
                return None
            buf = bytearray()
            async for chunk in resp.aiter_bytes():
                buf += chunk
                if len(buf) > max_bytes:
                    log.info("image URL %s: more than %d bytes", url[:200], max_bytes)
                    return None
            return bytes(buf)

    try:
        return await asyncio.wait_for(get(), timeout_s)
    except asyncio.TimeoutError:
        log.info("image URL %s: no answer within %g s", url[:200], timeout_s)
    except (httpx.HTTPError, httpcore.ConnectError, OSError) as exc:
        log.info("image URL %s: %s: %s", url[:200], type(exc).__name__, exc)
    return None
