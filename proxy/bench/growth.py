"""``splice bench overhead --growth TURNS``: does a turn cost more as its session gets longer?

Agents run tool loops of hundreds of turns with short messages, resending the whole history
every turn. A few sessions advance one turn at a time, in lockstep (each a header-less chat
of a system prompt, a task, and per turn one tool call and a short tool result), against a
Splice with ``--drift-check off``; the proxy's CPU is read around each window of turns, so the
table shows the cost per turn as the history grows from a few messages to ``2 * TURNS``.
"""

from __future__ import annotations

import socket

import orjson

from .tables import format_table
from .workload import SYSTEM, TOOL, USER


def _post(sock: socket.socket, f, body: bytes) -> bytes:
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%b" % (len(body), body))  # fmt: skip
    status = f.readline()
    n = 0
    while (line := f.readline()) not in (b"\r\n", b""):
        if line.lower().startswith(b"content-length:"):
            n = int(line.split(b":", 1)[1])
    data = f.read(n)
    if not status.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"growth phase: {status!r} {data[:200]!r}")
    return data


def run_growth(port: int, pid: int, turns: int, sessions: int, window: int, cpu_seconds) -> list[dict]:
    """Rows of {first, last, messages, cpu_ms_per_turn} per window of turn indices."""
    tools = [{"type": "function", "function": TOOL}]
    convs = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{USER} (session {s})"}] for s in range(sessions)]
    rows: list[dict] = []
    with socket.create_connection(("127.0.0.1", port)) as sock, sock.makefile("rb") as f:
        for start in range(0, turns, window):
            c0 = cpu_seconds(pid)
            n = 0
            for t in range(start, min(turns, start + window)):
                for msgs in convs:
                    reply = orjson.loads(_post(sock, f, orjson.dumps({"model": "m", "messages": msgs, "tools": tools, "max_tokens": 512})))
                    m = reply["choices"][0]["message"]
                    call = m["tool_calls"][0]
                    msgs.append({"role": "assistant", "content": m.get("content"), "tool_calls": m["tool_calls"]})
                    msgs.append({"role": "tool", "tool_call_id": call["id"], "content": f'{{"step": {t}, "ok": true, "lines": ["built", "tested"]}}'})
                    n += 1
            rows.append({"first": start, "last": start + window - 1, "messages": len(convs[0]) - 1,
                         "cpu_ms_per_turn": (cpu_seconds(pid) - c0) / n * 1e3})  # fmt: skip
    return rows


def print_growth(rows: list[dict], sessions: int) -> None:
    first = rows[0]["cpu_ms_per_turn"] if rows else None
    print(f"\nSession growth, C=1, {sessions} header-less sessions in lockstep, short messages, one tool call per turn, "
          "--drift-check off: proxy CPU per turn by turn index, against the first window.")  # fmt: skip
    out = [[f"{r['first']}-{r['last']}", r["messages"], f"{r['cpu_ms_per_turn']:.2f}",
            f"{r['cpu_ms_per_turn'] / first:.2f}" if first else ""] for r in rows]  # fmt: skip
    print(format_table(["turns", "messages at the end", "proxy CPU ms/turn", "x first"], out))
