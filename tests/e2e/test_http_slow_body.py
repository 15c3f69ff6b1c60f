"""Slow and missing request bodies over real sockets (uvicorn on 127.0.0.1 in this process with
the production HTTP protocol, a fixed engine pool): sockets that send a turn's headers and then
nothing, or one byte at a time, hold no admission slot, so real turns keep succeeding at the
admission limit; each slow socket gets a 408 once ``--body-timeout-s`` has passed and is closed;
a client that disconnects mid-body is one INFO line, no ERROR, no traceback."""

from __future__ import annotations

import http.client
import logging
import socket
import threading
import time

import httpx
import orjson
import pytest
import uvicorn

from engines.reference.launch import free_port
from proxy.app import create_app
from proxy.http_server import server_options
from proxy.settings import Settings
from tests.fakes.engines import FixedPool
from tokenization import ChatFormat, load_tokenizer, qwen3_tokenizer_dir

LIMIT = 4  # --max-inflight
BODY_TIMEOUT_S = 4.0
HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\n\r\n")  # fmt: skip
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tok = load_tokenizer(str(qwen3_tokenizer_dir()))
    settings = Settings(store=str(tmp_path_factory.mktemp("slow") / "s.sqlite"), max_context=4096, max_inflight=LIMIT,
                        admission_wait_s=0.5, body_timeout_s=BODY_TIMEOUT_S)  # fmt: skip
    app = create_app(settings, fmt=ChatFormat(tok, "qwen3"), pool=FixedPool(tok.encode("ok<|im_end|>", add_special_tokens=False)))
    port = free_port()
    limits = server_options(settings.max_header_bytes, settings.header_timeout_s, settings.keepalive_s)
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, **limits))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", port
    srv.should_exit = True
    t.join(10)


def _answer(s: socket.socket) -> bytes:
    out = b""
    while got := s.recv(65536):
        out += got
    return out


def test_slow_bodies_hold_no_slot_and_time_out(server):
    url, port = server
    stalled = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(4 * LIMIT)]
    for s in stalled:
        s.sendall(HEAD)  # and never the body
    trickling = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(LIMIT)]
    stop = threading.Event()

    def trickle():
        for s in trickling:
            s.sendall(HEAD)
        while not stop.wait(0.25):
            for s in trickling:
                try:
                    s.sendall(b" ")
                except OSError:
                    return

    th = threading.Thread(target=trickle, daemon=True)
    th.start()
    t0 = time.monotonic()
    time.sleep(0.5)
    try:
        # real turns, LIMIT at a time, while 5 x LIMIT sockets sit mid-body: none waits for a slot
        statuses = []
        with httpx.Client(base_url=url, timeout=30) as c:
            while time.monotonic() - t0 < BODY_TIMEOUT_S - 1:
                threads = []
                for _ in range(LIMIT):
                    th_i = threading.Thread(target=lambda: statuses.append(c.post("/v1/chat/completions", json=CHAT).status_code))
                    th_i.start()
                    threads.append(th_i)
                for th_i in threads:
                    th_i.join()
        assert statuses and set(statuses) == {200}, statuses
        # each slow socket: 408 in OpenAI's shape once the deadline passed, then closed
        for s in stalled + trickling:
            got = _answer(s)
            assert got.startswith(b"HTTP/1.1 408 "), got[:200]
            assert b"request_timeout" in got and b"request body not received within" in got
        waited = time.monotonic() - t0
        assert waited >= BODY_TIMEOUT_S - 0.5, waited
    finally:
        stop.set()
        for s in stalled + trickling:
            s.close()
    metrics = httpx.get(url + "/metrics", timeout=10).text
    assert "splice_admission_active 0.0" in metrics


def test_a_body_the_app_reads_has_the_deadline_too(server):
    """Not a turn (the route reads its own body): the same 408."""
    url, port = server
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST /v1/sessions/x/reward HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 50\r\n\r\n{")
        got = _answer(s)
    assert got.startswith(b"HTTP/1.1 408 "), got[:200]


def test_disconnect_mid_body_is_an_info_line(server, caplog):
    url, port = server
    caplog.set_level(logging.INFO)
    for path in (b"/v1/chat/completions", b"/v1/sessions/x/reward"):
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(HEAD.replace(b"/v1/chat/completions", path) + b'{"model": ')
            time.sleep(0.3)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and sum("went away" in r.getMessage() for r in caplog.records) < (1 if path.startswith(b"/v1/chat") else 2):
            time.sleep(0.05)
    gone = [r for r in caplog.records if "went away" in r.getMessage()]
    assert len(gone) == 2 and all(r.levelno == logging.INFO for r in gone), [r.getMessage() for r in caplog.records]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    assert httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=30).status_code == 200


def test_an_idle_agent_connection_outlives_the_clients_own_pool_idle_time(server):
    """An agent thinking for longer than uvicorn's default 5 s keep-alive sends its next turn on
    the same connection and gets the answer (the server is not the side that closes first)."""
    url, port = server
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        for i in range(2):
            if i:
                first = conn.sock
                time.sleep(6.0)
            conn.request("POST", "/v1/chat/completions", body=orjson.dumps(CHAT), headers={"Content-Type": "application/json"})
            reply = conn.getresponse()
            answer = orjson.loads(reply.read())
            assert reply.status == 200, reply.status
            assert answer["object"] == "chat.completion"
        assert conn.sock is first  # the same connection both times (http.client does not reconnect)
    finally:
        conn.close()
