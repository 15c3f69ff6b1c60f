"""The bench's clients send a long session's request without copying it behind its head and
deliver every byte in order; a refused turn ends the bench with the proxy's message. Checked on
real sockets."""

from __future__ import annotations

import asyncio
import socket
import threading

import numpy as np

from proxy.bench.growth import send_all
from proxy.bench.loadgen import Conn


def test_the_bench_client_sends_head_and_body_whole_through_partial_sends():
    """``growth.send_all`` (the long-session client): every byte, in order, when the socket takes
    each ``sendmsg`` only in part."""
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    parts = [b"POST / HTTP/1.1\r\n\r\n", b"", np.arange(800_000, dtype=np.int32).tobytes(), b"]"]
    got = bytearray()

    def read():
        while len(got) < sum(map(len, parts)):
            got.extend(b.recv(65536))

    reader = threading.Thread(target=read)
    reader.start()
    send_all(a, parts)
    reader.join(30)
    a.close(), b.close()
    assert bytes(got) == b"".join(parts)


def test_the_load_generator_posts_a_long_body_whole():
    """``loadgen.Conn.post`` writes a body beside its head (``writelines``): a server reading
    by Content-Length gets the exact bytes, then answers on the same connection."""
    body = np.arange(300_000, dtype=np.int32).tobytes()
    got: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(2):
            head = await reader.readuntil(b"\r\n\r\n")
            n = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")))
            got.append(await reader.readexactly(n))
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()
        writer.close()

    async def main():
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        conn = Conn("127.0.0.1", port)
        try:
            assert await conn.post("/v1/chat/completions", body, {}) == (200, b"ok")
            assert await conn.post("/v1/chat/completions", b"{}", {}) == (200, b"ok")
        finally:
            conn.close()
            server.close()

    asyncio.run(main())
    assert got == [body, b"{}"]


def test_a_refused_long_session_turn_ends_the_bench_with_the_proxys_message():
    """The alternating blocks' client stops on a refused turn with what the proxy said, not a traceback."""
    import pytest

    from proxy.bench.growth import _Chat

    refusal = b'{"error":{"message":"This model\'s maximum context length is 262144 tokens"}}'
    server = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = server.accept()
        f = conn.makefile("rb")
        n = 0
        while (line := f.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                n = int(line.split(b":", 1)[1])
        f.read(n)
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n%b" % (len(refusal), refusal))
        conn.close()

    t = threading.Thread(target=serve)
    t.start()
    chat = _Chat(server.getsockname()[1])
    try:
        with pytest.raises(SystemExit, match="400 Bad Request.*maximum context length is 262144"):
            chat.turn(chat.session("s"), 0)
    finally:
        chat.close()
        t.join(10)
        server.close()
