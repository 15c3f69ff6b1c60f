"""``python -m proxy.bench.http_body``: the HTTP server's CPU per request body, alone.

A uvicorn server with Splice's protocol (``proxy.http_server.server_options``) and an app that
only reads the body and answers a few bytes; one client sends bodies of each size over one
keep-alive connection. It prints the server process's CPU per request (its own CPU clock) and
its minor page faults per request, the median over rounds.

``--src DIR`` (repeatable) takes ``proxy.http_server`` from another checkout (a ``git worktree``
of an older release), so a before/after runs in alternating rounds on the same machine. glibc's
malloc thresholds are fixed by default (``--default-malloc``: as they come): a fresh server with
the dynamic ones faulted in every page of its 400 KB buffers on each request (three times the
CPU), which a proxy that has served a while does not (``splice bench overhead`` with the
proxy's ``/proc/PID/stat``: 0.03 faults per 100k-token turn), so they would measure the
allocator, not the server.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys

from .overhead import _cpu_seconds
from .stack import wait_http
from .tables import format_table

SERVER = """
import sys
sys.path.insert(0, sys.argv[2])
import uvicorn
from proxy.http_server import server_options

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    n = 0
    while True:
        m = await receive()
        n += len(m.get("body", b""))
        if not m.get("more_body"):
            break
    out = b'{"n":%d}' % n
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(out))]})
    await send({"type": "http.response.body", "body": out})

uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), loop="uvloop", log_level="warning",
            access_log=False, **server_options(65536, 10.0, 5.0))
"""

FIXED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(64 << 20), "MALLOC_TRIM_THRESHOLD_": str(512 << 20)}


def _faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])  # minflt, the 10th field


def measure(src: str, size: int, requests: int, *, default_malloc: bool = False) -> tuple[float, float]:
    """(server CPU µs per request, minor faults per request) for bodies of ``size`` bytes."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ) if default_malloc else {**os.environ, **FIXED_MALLOC}
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port), os.path.abspath(src)], env=env)
    try:
        why = wait_http(f"http://127.0.0.1:{port}/", proc, timeout=30)
        if why is not None:
            raise SystemExit(f"the server from {src} did not start: {why}")
        with socket.create_connection(("127.0.0.1", port)) as conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            body = b'{"input":"' + b"x" * max(0, size - 12) + b'"}'
            request = b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
            request += b"content-length: %d\r\n\r\n" % len(body) + body
            answer = b'{"n":%d}' % len(body)

            def one() -> None:
                conn.sendall(request)
                got = b""
                while not got.endswith(answer):
                    chunk = conn.recv(65536)
                    if not chunk:
                        raise SystemExit("the server closed the connection")
                    got += chunk

            for _ in range(min(200, requests)):  # warm-up
                one()
            f0, t0 = _faults(proc.pid), _cpu_seconds(proc.pid)
            for _ in range(requests):
                one()
            t1, f1 = _cpu_seconds(proc.pid), _faults(proc.pid)
        return (t1 - t0) / requests * 1e6, (f1 - f0) / requests
    finally:
        proc.terminate()
        proc.wait(10)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m proxy.bench.http_body", description=__doc__.split("\n\n")[0])
    p.add_argument("--src", action="append", help="a checkout to take proxy.http_server from (repeatable; default: this one)")
    p.add_argument("--sizes", type=int, nargs="+", default=[4_000, 400_000, 4_000_000], help="body sizes in bytes")
    p.add_argument("--requests", type=int, default=1000, help="timed requests per size and round")
    p.add_argument("--rounds", type=int, default=3, help="rounds, the sources' order reversed every round")
    p.add_argument("--default-malloc", action="store_true", help="leave glibc's dynamic malloc thresholds on")
    args = p.parse_args(argv)
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    srcs = args.src or [here]
    got: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for r in range(args.rounds):
        for src in srcs if r % 2 == 0 else srcs[::-1]:
            for size in args.sizes:
                got.setdefault((src, size), []).append(measure(src, size, args.requests, default_malloc=args.default_malloc))
    rows = [
        [src, f"{size:,}", f"{statistics.median(c for c, _ in v):.1f}", f"{statistics.median(f for _, f in v):.2f}",
         " ".join(f"{c:.0f}" for c, _ in v)]
        for (src, size), v in got.items()
    ]  # fmt: skip
    print(format_table(["source", "body bytes", "server CPU us/request", "minor faults/request", "rounds"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
