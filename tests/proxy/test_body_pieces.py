"""A request body reaches the app byte for byte while uvicorn's cycle keeps it as the parser's
pieces (proxy/http_server.py, ``BodyPieces``): over a real uvicorn server on 127.0.0.1 with
Splice's protocol, for bodies sent in one piece, in many, chunk-encoded, and large enough to
pause reading."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import time

import pytest

from proxy.http_server import BODY_HIGH_WATER, BodyPieces, server_options
from tests.fakes.serve import serve_in_thread

SEEN: list[tuple[int, bytes]] = []  # (receive calls, the body the app read)


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    parts, calls = [], 0
    # pieces pile up in the cycle before the first receive (/patient: long enough for 1 MB to arrive whole)
    await asyncio.sleep(1.0 if scope["path"] == "/patient" else 0.05)
    while True:
        message = await receive()
        calls += 1
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    body = b"".join(parts)
    SEEN.append((calls, body))
    answer = hashlib.sha256(body).hexdigest().encode() + b" %d" % len(body)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(answer))]})
    await send({"type": "http.response.body", "body": answer})


@pytest.fixture(scope="module")
def port():
    url, stop = serve_in_thread(app, loop="asyncio", **server_options(65536, 10.0, 5.0))
    yield int(url.rsplit(":", 1)[1])
    stop()


def _answer(sock: socket.socket) -> bytes:
    sock.settimeout(10)
    got = b""
    while b"\r\n\r\n" not in got:
        got += sock.recv(65536)
    head, _, rest = got.partition(b"\r\n\r\n")
    n = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(rest) < n:
        rest += sock.recv(65536)
    return rest


def _expect(body: bytes) -> bytes:
    return hashlib.sha256(body).hexdigest().encode() + b" %d" % len(body)


def test_bodies_in_one_piece_many_pieces_and_chunked_arrive_exact(port):
    rnd = os.urandom(BODY_HIGH_WATER + (2 << 20))  # past the high-water mark: reading pauses and resumes
    piled = False
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for body, pieces in ((b'{"a":1}', 1), (rnd[:400_000], 1), (rnd[:400_000], 40), (rnd, 7), (b"", 1)):
            SEEN.clear()
            c.sendall(b"POST /x HTTP/1.1\r\nhost: t\r\ncontent-length: %d\r\n\r\n" % len(body))
            step = max(1, -(-len(body) // pieces))
            for i in range(0, len(body), step):
                c.sendall(body[i : i + step])
                if pieces > 1:
                    time.sleep(0.002)  # separate reads on the server
            assert _answer(c) == _expect(body)  # keep-alive: every request on the same connection
            assert SEEN[-1][1] == body
            piled |= len(body) > 100_000 and SEEN[-1][0] < pieces  # some receive got several pieces
        # chunked transfer encoding: the parser hands the body over chunk by chunk
        chunks = [rnd[:1000], rnd[1000:70_000], rnd[70_000:70_001], rnd[70_001:500_000]]
        c.sendall(b"POST /x HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n")
        for ch in chunks:
            c.sendall(b"%x\r\n" % len(ch) + ch + b"\r\n")
            time.sleep(0.002)
        c.sendall(b"0\r\n\r\n")
        assert _answer(c) == _expect(rnd[:500_000])
    assert piled


def test_a_body_below_the_high_water_mark_is_read_without_a_pause(port):
    """1 MB sent at once while the app sleeps: the connection keeps reading (uvicorn's own mark,
    64 KB, paused it after the first read), so the app's first receive has all of it."""
    body = os.urandom(1 << 20)
    with socket.create_connection(("127.0.0.1", port)) as c:
        SEEN.clear()
        c.sendall(b"POST /patient HTTP/1.1\r\nhost: t\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        assert _answer(c) == _expect(body)
    assert SEEN == [(1, body)]


def test_body_pieces_hands_one_piece_over_uncopied_and_joins_several():
    piece = os.urandom(1000)
    one = BodyPieces()
    one += piece
    assert len(one) == 1000 and bytes(one) is piece
    several = BodyPieces(bytearray(b"ab"))  # what the cycle held before its first piece
    several += b"cd"
    several += b""
    several += b"e"
    assert len(several) == 5 and bytes(several) == b"abcde"
    assert bytes(BodyPieces()) == b"" and len(BodyPieces()) == 0
