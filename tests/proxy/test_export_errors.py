"""``splice export`` error paths: each is one line on stderr and exit status 2, never a
traceback; a file that is not a splice store is never written to; nothing to export writes no
file. The proxy-side failures come from a real HTTP server on loopback."""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from proxy.cli import main as splice
from proxy.store import Store

ANSWERS = {
    "/refuses": (401, "application/json", b'{"error": {"message": "Invalid or missing admin token: send\\n it", "type": "invalid_request_error", "param": null, "code": "invalid_api_key"}}'),
    "/html": (200, "text/html", b"<html>not a proxy</html>"),
    "/garbage": (200, "application/vnd.apache.arrow.stream", b"\x00\x01 definitely not arrow"),
}


@pytest.fixture(scope="module")
def server():
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            status, ctype, body = ANSWERS[self.path.split("/v1/")[0]]
            self.send_response(status)
            self.send_header("content-type", ctype)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_POST = do_GET  # noqa: N815

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _fails(capsys, argv: list[str], words: str) -> None:
    assert splice(["export", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("splice export: ") and words in err, err


def test_store_errors(tmp_path, capsys):
    out = str(tmp_path / "out")
    _fails(capsys, ["--store", str(tmp_path / "missing.sqlite"), "--out", out], "no store file")
    _fails(capsys, ["--store", str(tmp_path), "--out", out], "no store file")  # a directory
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"this is not sqlite" * 100)
    _fails(capsys, ["--store", str(junk), "--out", out], "is not a splice store")
    empty = tmp_path / "empty.sqlite"
    empty.touch()
    _fails(capsys, ["--store", str(empty), "--out", out], "is not a splice store")
    assert empty.stat().st_size == 0  # no schema written into it
    assert not (tmp_path / "out").exists()

    real = tmp_path / "s.sqlite"
    Store(str(real)).close()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    _fails(capsys, ["--store", str(real), "--out", str(blocker / "sub")], "Not a directory")
    assert splice(["export", "--store", str(real), "--out", out]) == 0  # nothing to export: no file
    assert list((tmp_path / "out").iterdir()) == []


def test_proxy_errors(tmp_path, capsys, server):
    out = str(tmp_path / "out")
    _fails(capsys, ["--proxy", f"http://127.0.0.1:{_closed_port()}", "--out", out], "cannot reach the proxy")
    _fails(capsys, ["--proxy", server + "/refuses", "--out", out, "--admin-token", "t"], "HTTP 401: Invalid or missing admin token: send it")
    _fails(capsys, ["--proxy", server + "/html", "--out", out, "--admin-token", "t"], "did not answer an Arrow stream")
    _fails(capsys, ["--proxy", server + "/garbage", "--out", out, "--admin-token", "t"], "not a readable Arrow stream")
    _fails(capsys, ["--proxy", server + "/refuses", "--out", out, "--consume", "--admin-token", "t"], "HTTP 401")
    assert list((tmp_path / "out").iterdir()) == []
