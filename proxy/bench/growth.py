"""``splice bench overhead --growth TURNS``: does a turn cost more as its session gets longer?

Agents run tool loops of hundreds of turns with short messages, resending the whole history
every turn. Some header-less chat sessions are first grown, untimed, to TURNS turns (a system
prompt, a task, and per turn one tool call and a short tool result: ``2 * TURNS + 2``
messages); then blocks of turns on those long sessions alternate with blocks on fresh short
sessions (their third to sixth turns), against a Splice with ``--drift-check off``. Alternating
blocks of a fraction of a second each keeps the machine's speed of the moment out of the
comparison, which windows of a run measured one after the other do not.
"""

from __future__ import annotations

import socket

import orjson

from .tables import format_table
from .workload import SYSTEM, TOOL, USER

TOOLS = [{"type": "function", "function": TOOL}]


class _Chat:
    """One keep-alive connection to Splice's chat endpoint."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.f = self.sock.makefile("rb")

    def turn(self, msgs: list[dict], t: int) -> None:
        """One turn of a session: send its history, append the answer and a tool result."""
        body = orjson.dumps({"model": "m", "messages": msgs, "tools": TOOLS, "max_tokens": 512})
        self.sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
                          b"content-length: %d\r\n\r\n%b" % (len(body), body))  # fmt: skip
        status = self.f.readline()
        n = 0
        while (line := self.f.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                n = int(line.split(b":", 1)[1])
        data = self.f.read(n)
        if not status.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"growth phase: {status!r} {data[:200]!r}")
        m = orjson.loads(data)["choices"][0]["message"]
        call = m["tool_calls"][0]
        msgs.append({"role": "assistant", "content": m.get("content"), "tool_calls": m["tool_calls"]})
        msgs.append({"role": "tool", "tool_call_id": call["id"], "content": f'{{"step": {t}, "ok": true, "lines": ["built", "tested"]}}'})

    def close(self) -> None:
        self.f.close()
        self.sock.close()


def _session(name: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{USER} ({name})"}]


def run_growth(port: int, pid: int, turns: int, sessions: int, rounds: int, cpu_seconds) -> dict:
    """CPU per turn on sessions of ``turns`` turns against fresh ones, in alternating blocks."""
    chat = _Chat(port)
    try:
        long = [_session(f"long {s}") for s in range(sessions)]
        for t in range(turns):  # grown untimed
            for msgs in long:
                chat.turn(msgs, t)
        cpu = {"short": 0.0, "long": 0.0}
        n = {"short": 0, "long": 0}
        for r in range(rounds):
            short = [_session(f"short {r}.{s}") for s in range(sessions)]
            for t in range(2):  # a full render and the first splice, untimed
                for msgs in short:
                    chat.turn(msgs, t)
            for kind, group in (("short", short), ("long", long)) if r % 2 == 0 else (("long", long), ("short", short)):
                c0 = cpu_seconds(pid)
                for _ in range(4):
                    for msgs in group:
                        chat.turn(msgs, len(msgs) // 2)
                cpu[kind] += cpu_seconds(pid) - c0
                n[kind] += 4 * len(group)
    finally:
        chat.close()
    return {"turns": turns, "sessions": sessions, "rounds": rounds, "long_messages": [2 * turns + 2, len(long[0])],
            "short_ms": cpu["short"] / n["short"] * 1e3, "long_ms": cpu["long"] / n["long"] * 1e3,
            "turns_timed": n}  # fmt: skip


def print_growth(g: dict) -> None:
    print(f"\nSession growth, C=1, header-less chat sessions, short messages, one tool call per turn, --drift-check off: "
          f"{g['sessions']} sessions grown to {g['turns']} turns, then {g['rounds']} rounds of alternating blocks "
          "(4 turns of each long session, 4 of each fresh short one); proxy CPU per timed turn.")  # fmt: skip
    rows = [["short (6-12 messages)", g["turns_timed"]["short"], f"{g['short_ms']:.2f}", "1.00"],
            [f"long ({g['long_messages'][0]}-{g['long_messages'][1]} messages)", g["turns_timed"]["long"], f"{g['long_ms']:.2f}",
             f"{g['long_ms'] / g['short_ms']:.2f}"]]  # fmt: skip
    print(format_table(["sessions", "turns timed", "proxy CPU ms/turn", "x short"], rows))
