"""``splice bench overhead --stall`` runs end to end (small sizes): short turns alone, then beside
long first turns that reach the proxy and are answered (no timing is asserted)."""

from __future__ import annotations

import json

from proxy.cli import main as splice


def test_bench_overhead_stall_small(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "overhead.json"
    args = ["bench", "overhead", "-c", "1", "--no-litellm", "--min-turns", "24", "--stall", "3000", "--stall-c", "2",
            "--stall-pause", "0.01", "--out", str(out)]  # fmt: skip
    assert splice(args) == 0
    alone, beside = json.loads(out.read_text())["stall"]
    assert not alone["beside"] and beside["beside"]
    assert alone["turns"] == beside["turns"] > 0 and alone["n_errors"] == beside["n_errors"] == 0
    assert "stall_turns" not in alone and beside["stall_turns"] >= 1 and beside["stall_mean_ms"] > 0
    assert alone["max_ms"] >= alone["p99_ms"] >= alone["p50_ms"] > 0
    printed = capsys.readouterr().out
    assert "beside 3,000-token first turns" in printed and "long turn mean ms" in printed


def test_the_long_turn_sender_stops_when_its_cancel_is_lost(monkeypatch):
    """The workers are done but the long-turn sender's cancel is lost (Python 3.11's ``wait_for``
    drops a cancel that lands as its request completes): the load generator still ends, because
    the sender checks that the workers are done before each request. Before, it sent long turns
    until the caller's timeout killed it."""
    import asyncio

    from proxy.bench import loadgen

    reply = json.dumps({"choices": [{"message": {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "step", "arguments": "{}"}}]}}]}).encode()  # fmt: skip
    posts = {"long": 0}

    async def serve(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                size = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")))
                body = await reader.readexactly(size)
                posts["long"] += b'"tools"' not in body
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(reply), reply))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    class LostCancel:
        """The sender's task, whose ``cancel`` never arrives."""

        def __init__(self, task):
            self.task = task

        def cancel(self) -> bool:
            return False

        def __await__(self):
            return self.task.__await__()

    real = asyncio.ensure_future

    def ensure_future(coro, **kw):
        task = real(coro, **kw)
        return LostCancel(task) if getattr(coro, "__name__", "") == "staller" else task

    monkeypatch.setattr(loadgen.asyncio, "ensure_future", ensure_future)

    async def main():
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        spec = {"host": "127.0.0.1", "port": port, "mode": "chat", "c": 1, "sessions_per_worker": 2, "turns": 3,
                "deadline_s": 30, "model": "m", "messages": [{"role": "user", "content": "go"}], "tools": [],
                "stall": {"text": "long", "pause_s": 0.001}}  # fmt: skip
        try:
            return await asyncio.wait_for(loadgen.run(spec), 10)
        finally:
            server.close()

    out = asyncio.run(main())
    assert len(out["lat"]) == 6 and not out["errors"]
    assert posts["long"] >= 1 and len(out["stall_lat"]) <= posts["long"]
