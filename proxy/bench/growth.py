"""``splice bench overhead --growth TURNS``: does a turn cost more as its session gets longer?

Agents run tool loops of hundreds of turns with short messages, resending the whole history
every turn. Some header-less sessions (chat, Responses API input lists as Codex and the Agents
SDK send them, or Anthropic Messages as Claude Code sends them) are first grown, untimed, to TURNS turns (a system
prompt, a task, and per turn one tool call and a short tool result: ``2 * TURNS + 2``
messages); then blocks of turns on those long sessions alternate with blocks on fresh short
sessions (their third to sixth turns), against a Splice with ``--drift-check off``. Alternating
blocks of a fraction of a second each keeps the machine's speed of the moment out of the
comparison, which windows of a run measured one after the other do not.
"""

from __future__ import annotations

import socket
import time

import orjson

from .tables import format_table
from .workload import SYSTEM, TOOL, USER

TOOLS = [{"type": "function", "function": TOOL}]
RESPONSES_TOOLS = [{"type": "function", **TOOL}]
MESSAGES_TOOLS = [{"name": TOOL["name"], "description": TOOL["description"], "input_schema": TOOL["parameters"]}]
APIS = ("chat", "responses", "messages")


def send_all(sock: socket.socket, parts: list[bytes]) -> None:
    """``parts`` back to back in as few ``sendmsg`` calls as the socket takes: a 400 KB request is
    not copied behind its head first (the client shares the proxy's cores and caches)."""
    views = [memoryview(p) for p in parts if p]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views.pop(0))
        if sent:
            views[0] = views[0][sent:]


def _result(step: int) -> str:
    return f'{{"step": {step}, "ok": true, "lines": ["built", "tested"]}}'


class _Chat:
    """One keep-alive connection to Splice's chat endpoint."""

    path = b"/v1/chat/completions"

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.f = self.sock.makefile("rb")

    def session(self, name: str) -> list[dict]:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{USER} ({name})"}]

    def body(self, msgs: list[dict]) -> bytes:
        return orjson.dumps({"model": "m", "messages": msgs, "tools": TOOLS, "max_tokens": 512})

    def extend(self, msgs: list[dict], answer: dict, t: int) -> None:
        """Append the answer and a tool result."""
        m = answer["choices"][0]["message"]
        call = m["tool_calls"][0]
        msgs.append({"role": "assistant", "content": m.get("content"), "tool_calls": m["tool_calls"]})
        msgs.append({"role": "tool", "tool_call_id": call["id"], "content": _result(t)})

    def turn(self, msgs: list[dict], t: int) -> None:
        """One turn of a session: send its history, append the answer and a tool result."""
        body = self.body(msgs)
        head = b"POST %b HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
        send_all(self.sock, [head % (self.path, len(body)), body])
        status = self.f.readline()
        n = 0
        while (line := self.f.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                n = int(line.split(b":", 1)[1])
        data = self.f.read(n)
        if not status.startswith(b"HTTP/1.1 200"):
            # a request the proxy refuses (a history past the engine's context, say): its message, not a traceback
            raise SystemExit(f"long-session turn refused: {status.decode('latin-1').strip()}: {data[:300].decode('utf-8', 'replace')}")
        self.extend(msgs, orjson.loads(data), t)

    def close(self) -> None:
        self.f.close()
        self.sock.close()


class _Responses(_Chat):
    """The Responses API the way Codex and the Agents SDK use it without
    ``previous_response_id``: the whole input list every turn, output items appended to it."""

    path = b"/v1/responses"

    def session(self, name: str) -> list[dict]:
        return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"{USER} ({name})"}]}]

    def body(self, items: list[dict]) -> bytes:
        return orjson.dumps({"model": "m", "instructions": SYSTEM, "input": items, "tools": RESPONSES_TOOLS,
                             "max_output_tokens": 512})  # fmt: skip

    def extend(self, items: list[dict], answer: dict, t: int) -> None:
        out = answer["output"]
        items.extend(out)
        call = next(o for o in out if o["type"] == "function_call")
        items.append({"type": "function_call_output", "call_id": call["call_id"], "output": _result(t)})


class _Messages(_Chat):
    """Anthropic Messages the way Claude Code sends them: the whole history every turn, a
    session header, and a ``cache_control`` marker on the newest block (moved every turn)."""

    path = b"/v1/messages"

    def session(self, name: str) -> list[dict]:
        return [{"role": "user", "content": [{"type": "text", "text": f"{USER} ({name})"}]}]

    def body(self, msgs: list[dict]) -> bytes:
        last = msgs[-1]
        marked = {**last, "content": [*last["content"][:-1], {**last["content"][-1], "cache_control": {"type": "ephemeral"}}]}
        return orjson.dumps({"model": "m", "max_tokens": 512, "system": [{"type": "text", "text": SYSTEM}],
                             "messages": [*msgs[:-1], marked], "tools": MESSAGES_TOOLS})  # fmt: skip

    def extend(self, msgs: list[dict], answer: dict, t: int) -> None:
        msgs.append({"role": "assistant", "content": answer["content"]})
        use = next(b for b in answer["content"] if b["type"] == "tool_use")
        msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": _result(t)}]})


_CLIENTS = {"chat": _Chat, "responses": _Responses, "messages": _Messages}


def alternate(chat: _Chat, pid: int, cpu_seconds, groups: dict, rounds: int, *, block: int = 4, before_round=None) -> tuple[dict, dict]:
    """Proxy CPU seconds and turns timed per group of sessions: ``rounds`` rounds, each a block of
    ``block`` turns of every session of each group, the groups' order reversed every round.
    ``before_round(r)`` may replace groups first (fresh sessions), untimed."""
    cpu = {k: 0.0 for k in groups}
    n = {k: 0 for k in groups}
    for r in range(rounds):
        if before_round is not None:
            before_round(r)
        for kind in list(groups) if r % 2 == 0 else list(groups)[::-1]:
            c0 = cpu_seconds(pid)
            for _ in range(block):
                for msgs in groups[kind]:
                    chat.turn(msgs, len(msgs) // 2)
            cpu[kind] += cpu_seconds(pid) - c0
            n[kind] += block * len(groups[kind])
    return cpu, n


def run_growth(port: int, pid: int, turns: int, sessions: int, rounds: int, cpu_seconds, api: str = "chat") -> dict:
    """CPU per turn on sessions of ``turns`` turns against fresh ones, in alternating blocks."""
    chat = _CLIENTS[api](port)
    try:
        long = [chat.session(f"long {api} {s}") for s in range(sessions)]
        for t in range(turns):  # grown untimed
            for msgs in long:
                chat.turn(msgs, t)
        grown = len(long[0])
        groups = {"short": [], "long": long}

        def fresh(r: int) -> None:
            groups["short"] = [chat.session(f"short {api} {r}.{s}") for s in range(sessions)]
            for t in range(2):  # a full render and the first splice, untimed
                for msgs in groups["short"]:
                    chat.turn(msgs, t)

        cpu, n = alternate(chat, pid, cpu_seconds, groups, rounds, before_round=fresh)
    finally:
        chat.close()
    return {"api": api, "turns": turns, "sessions": sessions, "rounds": rounds, "long_items": [grown, len(long[0])],
            "short_ms": cpu["short"] / n["short"] * 1e3, "long_ms": cpu["long"] / n["long"] * 1e3,
            "turns_timed": n}  # fmt: skip


def run_history(port: int, pid: int, docs: dict[int, str], sessions: int, rounds: int, cpu_seconds) -> dict:
    """CPU per turn on sessions whose first message carries each history (``docs``: tokens ->
    text, 0 for none), in alternating blocks: the ratio to the short history is of the same
    moments of the machine. Each session's first turn (the whole history rendered) is untimed."""
    chat = _Chat(port)
    try:
        groups = {}
        for size, doc in docs.items():
            groups[size] = []
            for s in range(sessions):
                msgs = chat.session(f"history {size} {s} {time.time_ns()}")
                if doc:
                    msgs[-1]["content"] += "\n\nThe file to work on:\n" + doc
                chat.turn(msgs, 0)
                groups[size].append(msgs)
        cpu, n = alternate(chat, pid, cpu_seconds, groups, rounds)
    finally:
        chat.close()
    return {"sessions": sessions, "rounds": rounds, "turns_timed": n, "ms": {k: cpu[k] / n[k] * 1e3 for k in cpu}}


def print_history(h: dict, measured: dict[int, int]) -> None:
    short = h["ms"].get(0)
    print(f"\nThe same sizes in alternating blocks ({h['rounds']} rounds of 4 turns of each of {h['sessions']} fresh "
          "session(s) per size, the order reversed every round): the ratio compares the same moments of the machine.")
    rows = [[f"{measured.get(k, k):,}", h["turns_timed"][k], f"{ms:.2f}", f"{ms / short:.2f}" if short else ""] for k, ms in h["ms"].items()]
    print(format_table(["history tokens", "turns timed", "proxy CPU ms/turn", "x short"], rows))


def print_growth(g: dict) -> None:
    unit = "input items" if g.get("api") == "responses" else "messages"
    print(f"\nSession growth, C=1, header-less {g.get('api', 'chat')} sessions, short messages, one tool call per turn, "
          "--drift-check off: "
          f"{g['sessions']} sessions grown to {g['turns']} turns, then {g['rounds']} rounds of alternating blocks "
          "(4 turns of each long session, 4 of each fresh short one); proxy CPU per timed turn.")  # fmt: skip
    rows = [["short (turns 3-6)", g["turns_timed"]["short"], f"{g['short_ms']:.2f}", "1.00"],
            [f"long ({g['long_items'][0]}-{g['long_items'][1]} {unit})", g["turns_timed"]["long"], f"{g['long_ms']:.2f}",
             f"{g['long_ms'] / g['short_ms']:.2f}"]]  # fmt: skip
    print(format_table(["sessions", "turns timed", "proxy CPU ms/turn", "x short"], rows))
