"""Bad input over real HTTP (``splice serve`` with the reference engine): every case is answered
with an error the client actually reads, in its API's shape, and nothing stored is lost.

- control characters in any id (session / group ids in headers, ``metadata`` or a client's own
  conversation id; ``previous_response_id``): 400, never a dropped connection;
- a session id with ``/`` works everywhere (read, listed, rewarded, pulled), sent as ``%2F``
  or as is; one outside ASCII comes back percent-encoded in ``X-Splice-Session-Id``;
- a 100 MB body (with a length, or chunked): the client reads the 413;
- 8 MB of headers: the client reads a 431; headers sent too slowly: 408 and the socket closes;
- unknown routes and methods under ``/v1/messages``: Anthropic's error shape.
"""

from __future__ import annotations

import socket
import time
from urllib.parse import quote

import httpx
import orjson
import pytest

from tests.e2e.conftest import kill_tree, start_proxy

pytestmark = pytest.mark.slow

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def proxy(tmp_path_factory, model_dir):
    p = start_proxy(tmp_path_factory.mktemp("bad-input"), model_dir, script=["ok<|im_end|>"], extra=["--header-timeout-s", "1"])
    yield p
    kill_tree(p)


def _openai_400(r: httpx.Response, needle: str) -> None:
    assert r.status_code == 400, (r.status_code, r.text)
    err = r.json()["error"]
    assert {"message", "type", "code"} <= set(err) and needle in err["message"], err


def test_control_characters_in_ids_are_400(proxy):
    ok = proxy.post("/v1/chat/completions", CHAT, headers={"X-Session-Id": "intact"})
    assert ok.status_code == 200
    cases = [
        ("/v1/chat/completions", {**CHAT, "metadata": {"session_id": "ep\x00-1"}}, {}),
        ("/v1/chat/completions", {**CHAT, "metadata": {"session_id": "ep-1", "group_id": "g\n1"}}, {}),
        ("/v1/chat/completions", CHAT, {"X-Session-Id": "ep\t1"}),
        ("/v1/chat/completions", {**CHAT, "metadata": {"user_id": '{"session_id": "cc\\u0000x"}'}}, {}),  # Claude Code's own id
        ("/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 2, "metadata": {"session_id": "r\x00"}}, {}),
        ("/v1/responses", {"model": "m", "input": "hi", "previous_response_id": "resp_\x00"}, {}),
    ]
    for path, body, headers in cases:
        _openai_400(proxy.post(path, body, headers=headers), "control character")
    r = proxy.post("/v1/messages", {"model": "m", "max_tokens": 2, "messages": CHAT["messages"], "metadata": {"session_id": "a\x00"}})
    assert r.status_code == 400 and r.json()["type"] == "error" and "control character" in r.json()["error"]["message"]
    # nothing stored was touched, and the server still answers on the same kind of request
    assert len(proxy.get("/v1/sessions/intact").json()["turns"]) == 1
    assert proxy.post("/v1/chat/completions", CHAT, headers={"X-Session-Id": "intact"}).status_code == 200


def test_a_session_id_with_a_slash_works_everywhere(proxy):
    sid = "team/ep 1"
    r = proxy.post("/v1/chat/completions", CHAT, headers={"X-Session-Id": sid, "X-Group-Id": "slash-g", "X-Group-Size": "1"})
    assert r.status_code == 200 and r.headers["x-splice-session-id"] == sid
    enc = quote(sid, safe="")
    assert proxy.get(f"/v1/sessions/{enc}").json()["session_id"] == sid
    assert proxy.get("/v1/sessions/team/ep%201").json()["session_id"] == sid  # "/" sent as is
    assert [s["session_id"] for s in proxy.get("/v1/sessions?group_id=slash-g").json()["data"]] == [sid]
    assert proxy.post(f"/v1/sessions/{enc}/reward", {"reward": 1.0}).json()["reward"] == 1.0
    samples = proxy.post("/v1/trajectories/pull", {"max_samples": 100}).json()["samples"]
    assert sid in {s["session_id"] for s in samples}  # so it is trained on

    r = proxy.post("/v1/chat/completions", CHAT, headers={"X-Session-Id": quote("épisode/1")})
    assert r.status_code == 200
    r = proxy.post("/v1/chat/completions", {**CHAT, "metadata": {"session_id": "épisode/2"}})
    assert r.status_code == 200 and r.headers["x-splice-session-id"] == quote("épisode/2", safe=" !\"#$&'()*+,/:;<=>?@[\\]^_`{|}~")
    assert proxy.get(f"/v1/sessions/{quote('épisode/2', safe='')}").status_code == 200


def test_a_100_mb_body_gets_a_413_the_client_reads(proxy):
    big = b"x" * (100 << 20)
    r = httpx.post(proxy.url + "/v1/chat/completions", content=big, headers={"content-type": "application/json"}, timeout=120)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():
        for _ in range(100):
            yield b"x" * (1 << 20)

    r = httpx.post(proxy.url + "/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"}, timeout=120)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert proxy.post("/v1/chat/completions", CHAT).status_code == 200


def _raw(url: str, data: bytes, *, chunk: int = 1 << 16) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        try:
            for i in range(0, len(data), chunk):
                s.sendall(data[i : i + chunk])
        except (BrokenPipeError, ConnectionResetError):
            pass
        out = b""
        while True:
            got = s.recv(65536)
            if not got:
                return out
            out += got


def test_8_mb_of_headers_get_a_431_the_client_reads(proxy):
    req = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (8 << 20) + b"\r\n\r\n"
    out = _raw(proxy.url, req)
    assert out.startswith(b"HTTP/1.1 431 "), out[:200]
    assert b'"code":"request_header_fields_too_large"' in out
    assert httpx.get(proxy.url + "/health", headers={"X-Fine": "a" * 8000}, timeout=30).status_code == 200


def test_a_control_character_in_a_header_is_a_400_in_openai_shape(proxy):
    """The HTTP parser itself refuses it; the answer is still the API's shape."""
    for bad in (b"X-Session-Id: ep\x00-1", b"X-Group-Id: g\x01"):
        out = _raw(proxy.url, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + bad + b"\r\nContent-Length: 2\r\n\r\n{}")
        assert out.startswith(b"HTTP/1.1 400 "), out[:200]
        body = out.split(b"\r\n\r\n", 1)[1]
        assert set(orjson.loads(body)["error"]) >= {"message", "type", "code"}


def test_headers_sent_too_slowly_get_a_408_and_the_socket_closes(proxy):
    host, port = proxy.url.removeprefix("http://").split(":")
    t0 = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
        out = b""
        while got := s.recv(65536):
            out += got
    assert out.startswith(b"HTTP/1.1 408 "), out[:200]
    assert time.monotonic() - t0 < 10
    with socket.create_connection((host, int(port)), timeout=30) as s:  # an idle socket is closed too
        assert s.recv(65536).startswith(b"HTTP/1.1 408 ")


def test_a_keep_alive_connection_gets_the_header_deadline_per_request(proxy):
    """Requests that each send their headers in time are never cut off, however long the
    connection lives (here 2.7 header timeouts); a later request that stalls mid-headers gets
    its 408 one timeout after it began, not sooner."""
    host, port = proxy.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        f = s.makefile("rb")
        for _ in range(9):  # every 0.3 s for 2.7 s, with --header-timeout-s 1
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert f.readline().startswith(b"HTTP/1.1 200 ")
            length = 0
            while (line := f.readline()) != b"\r\n":
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            f.read(length)
            time.sleep(0.3)
        t0 = time.monotonic()
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
        assert f.readline().startswith(b"HTTP/1.1 408 ")
        waited = time.monotonic() - t0
    assert 0.8 <= waited < 5, waited


def test_unknown_routes_under_messages_answer_in_anthropic_shape(proxy):
    for method, path, status in (("GET", "/v1/messages", 405), ("POST", "/v1/messages/nope", 404), ("GET", "/v1/messages/count_tokens", 405)):
        r = httpx.request(method, proxy.url + path, json={}, timeout=30)
        assert r.status_code == status, (path, r.text)
        body = r.json()
        assert body["type"] == "error" and body["error"]["type"] in ("not_found_error", "invalid_request_error"), body
    r = httpx.get(proxy.url + "/v1/nope", timeout=30)
    assert r.status_code == 404 and set(r.json()) == {"error"}  # elsewhere: OpenAI's shape
