"""Image URL fetches cannot reach what only the proxy can: loopback, private, link-local and
multicast targets are refused after DNS resolution (checked by resolution only: nothing is sent
beyond loopback) and on every redirect; every failure reads the same; only bytes that decoded
as an image are remembered. The fetches that do happen go to a real server on loopback, allowed
by ``--image-url-allow-net 127.0.0.1/32`` as an operator would allow an internal image store."""

from __future__ import annotations

import asyncio
import ipaddress
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from proxy.api.image_fetch import FETCH_FAILED, RefusedAddress, resolve_checked
from proxy.api.images import ImageInput
from proxy.errors import APIError
from tests.proxy.api.test_images_input import SHOT
from tests.proxy.api.test_images_input import folder, spec  # noqa: F401
from proxy.api.chat import messages_to_conversation as chat_messages
from tokenization.vision import decode_image

REFUSED_LITERALS = ["127.0.0.1", "127.8.9.10", "::1", "10.0.0.1", "172.16.5.4", "192.168.1.1", "169.254.169.254",
                    "fe80::1", "fc00::1", "224.0.0.1", "ff02::1", "0.0.0.0", "::", "100.64.0.1", "::ffff:127.0.0.1",
                    "::ffff:10.0.0.1", "2002:7f00:1::1", "255.255.255.255"]  # fmt: skip


@pytest.mark.parametrize("addr", REFUSED_LITERALS)
def test_non_public_literals_are_refused(addr):
    with pytest.raises(RefusedAddress):
        asyncio.run(resolve_checked(addr, 80))


def test_names_are_checked_on_what_they_resolve_to():
    async def resolver(host, port):
        return {"mixed.example": ["93.184.216.34", "10.0.0.1"], "public.example": ["93.184.216.34", "2606:2800:220:1::1"],
                "meta.example": ["169.254.169.254"], "empty.example": []}[host]  # fmt: skip

    for host in ("mixed.example", "meta.example", "empty.example"):
        with pytest.raises(RefusedAddress):
            asyncio.run(resolve_checked(host, 80, resolver=resolver))
    assert asyncio.run(resolve_checked("public.example", 80, resolver=resolver)) == ["93.184.216.34", "2606:2800:220:1::1"]
    with pytest.raises(RefusedAddress):  # the system resolver: localhost is loopback
        asyncio.run(resolve_checked("localhost", 80))
    allow = [ipaddress.ip_network("10.0.0.0/8")]
    assert asyncio.run(resolve_checked("mixed.example", 80, allow, resolver=resolver)) == ["93.184.216.34", "10.0.0.1"]


@pytest.fixture(scope="module")
def host():
    """A loopback server: an image, a redirect to wherever ``?to=`` says, bytes that are no image, a 404."""
    hits: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            hits.append(self.path)
            if self.path.startswith("/redirect?to="):
                self.send_response(302)
                self.send_header("location", self.path.split("=", 1)[1])
                self.end_headers()
                return
            body = {"/shot.png": SHOT, "/notimage": b"\0" * 100_000}.get(self.path)
            if body is None:
                self.send_response(404)
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", srv.server_address[1], hits
    srv.shutdown()
    srv.server_close()


def _convert(images: ImageInput, url: str):
    async def go():
        part = {"type": "image_url", "image_url": {"url": url}}
        req = await images.prepare({"messages": [{"role": "user", "content": [part]}]})
        return chat_messages([{"role": "user", "content": [part]}], req)

    return asyncio.run(go())


def _refused(images: ImageInput, url: str) -> str:
    with pytest.raises(APIError) as ei:
        _convert(images, url)
    assert ei.value.status == 400 and ei.value.code == "invalid_image"
    return ei.value.message


def test_loopback_and_private_targets_are_refused_before_any_traffic(spec, host):  # noqa: F811
    base, port, hits = host
    images = ImageInput(spec=spec, allow_urls=True, fetch_timeout_s=5)
    before = len(hits)
    for url in (f"{base}/shot.png", f"http://[::1]:{port}/shot.png", f"http://localhost:{port}/shot.png",
                "http://10.0.0.1/x.png", "http://169.254.169.254/latest/meta-data/", "http://[fe80::1]/x.png",
                "http://224.0.0.1/x.png"):  # fmt: skip
        assert _refused(images, url).endswith(FETCH_FAILED)
    assert len(hits) == before  # refused at resolution: the loopback server saw nothing


def test_redirects_to_non_public_targets_are_refused(spec, host):  # noqa: F811
    base, port, hits = host
    images = ImageInput(spec=spec, allow_urls=True, fetch_timeout_s=5, allow_nets=(ipaddress.ip_network("127.0.0.1/32"),))
    (msg,), _ = _convert(images, f"{base}/redirect?to={base}/shot.png")  # within the allowed network: fetched
    assert msg.images[0].hash == decode_image(SHOT, spec).hash
    for target in (f"http://127.0.0.2:{port}/shot.png", f"http://[::1]:{port}/shot.png", f"http://[::ffff:127.0.0.2]:{port}/x",
                   "http://169.254.169.254/latest/meta-data/", "http://10.1.2.3/x.png"):  # fmt: skip
        n = len(hits)
        assert _refused(images, f"{base}/redirect?to={target}").endswith(FETCH_FAILED)
        assert hits[n:] == [f"/redirect?to={target}"]  # only the first hop reached a server


def test_every_failure_reads_the_same_and_only_images_are_remembered(spec, host):  # noqa: F811
    base, port, hits = host
    allow = (ipaddress.ip_network("127.0.0.1/32"),)
    images = ImageInput(spec=spec, allow_urls=True, fetch_timeout_s=5, allow_nets=allow)
    import socket

    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    messages = {
        "404": _refused(images, f"{base}/missing.png"),
        "closed port": _refused(images, f"http://127.0.0.1:{closed_port}/x.png"),
        "not an image": _refused(images, f"{base}/notimage"),
        "refused address": _refused(images, "http://10.0.0.1/x.png"),
        "bad name": _refused(images, "http://no-such-host.invalid/x.png"),
    }
    assert len(set(messages.values())) == 1, messages
    n = len(hits)
    _refused(images, f"{base}/notimage")
    assert hits[n:] == ["/notimage"]  # fetched again: bytes that were no image were not kept
    assert f"{base}/notimage" not in images._url_cache
    _convert(images, f"{base}/shot.png")
    _convert(images, f"{base}/shot.png")
    assert hits[n + 1 :] == ["/shot.png"]  # an image: remembered, fetched once
