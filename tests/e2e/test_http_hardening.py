"""Hardening over a real socket (uvicorn on 127.0.0.1 in this process, a fixed engine pool):
keep-alive survives an unexpected error, a chunked upload is cut at the body limit, and a
10 MB message does not stall /health."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import orjson
import pytest
import uvicorn

from engines.reference.launch import free_port
from proxy.app import create_app
from proxy.settings import Settings
from tests.fakes.engines import FixedPool
from tokenization import ChatFormat, load_tokenizer, qwen3_tokenizer_dir


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tok = load_tokenizer(str(qwen3_tokenizer_dir()))
    store = str(tmp_path_factory.mktemp("hardening") / "s.sqlite")
    settings = Settings(store=store, max_context=32768, max_request_bytes=1024 * 1024 * 12)
    app = create_app(settings, fmt=ChatFormat(tok, "qwen3"), pool=FixedPool(tok.encode("ok<|im_end|>", add_special_tokens=False)))

    @app.get("/boom")
    async def boom():
        raise RuntimeError("unexpected")

    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield port
    srv.should_exit = True
    t.join(10)


def _read_response(f) -> tuple[int, dict[str, str], bytes]:
    status = int(f.readline().split()[1])
    headers = {}
    while (line := f.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode().partition(":")
        headers[k.strip().lower()] = v.strip()
    body = f.read(int(headers.get("content-length", "0")))
    return status, headers, body


def test_keep_alive_connection_survives_an_unexpected_error(server):
    with socket.create_connection(("127.0.0.1", server), timeout=10) as s:
        f = s.makefile("rb")
        s.sendall(b"GET /boom HTTP/1.1\r\nHost: t\r\n\r\n")
        status, _, body = _read_response(f)
        assert status == 500
        assert orjson.loads(body)["error"]["code"] == "internal_error"
        s.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")  # same connection
        status, _, body = _read_response(f)
        assert status == 200 and orjson.loads(body)["status"] == "ok"


def test_chunked_upload_is_cut_at_the_limit(server):
    """Past the limit nothing more is kept; the rest of the upload is read and dropped, so the
    client (still sending) reads a real 413 instead of a connection reset."""
    with socket.create_connection(("127.0.0.1", server), timeout=60) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"a" * (1024 * 1024)
        sent = 0
        head = b'{"messages": [{"role": "user", "content": "'
        s.sendall(b"%x\r\n" % len(head) + head + b"\r\n")
        while sent < 100 * 1024 * 1024:
            s.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
            sent += len(chunk)
        s.sendall(b"0\r\n\r\n")
        status, _, body = _read_response(s.makefile("rb"))
    assert status == 413 and b"request_too_large" in body, body
    assert httpx.get(f"http://127.0.0.1:{server}/health", timeout=5).status_code == 200


def test_a_10mb_message_does_not_stall_health(server):
    big = {"messages": [{"role": "user", "content": "a " * 5_000_000}]}  # legal size, cannot fit 32k tokens
    result = {}

    def post():
        result["r"] = httpx.post(f"http://127.0.0.1:{server}/v1/chat/completions", json=big, timeout=60)

    t = threading.Thread(target=post)
    t.start()
    worst = 0.0
    while t.is_alive():
        t0 = time.perf_counter()
        assert httpx.get(f"http://127.0.0.1:{server}/health", timeout=10).status_code == 200
        worst = max(worst, time.perf_counter() - t0)
        time.sleep(0.05)
    t.join()
    assert result["r"].status_code == 400
    assert result["r"].json()["error"]["code"] == "context_length_exceeded"
    assert worst < 2.0, worst  # was 7-10 s
