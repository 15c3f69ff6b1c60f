"""Load generator for ``splice bench overhead``: ``python loadgen.py SPEC.json`` prints JSON results.

Runs in its own process so its CPU is not mixed with the orchestrating process or the proxies.
C workers each run their sessions back to back; a session is a multi-turn tool-using
conversation: every reply must carry a tool call, which is answered with a tool message and
sent back with the whole history (or, in token space, the ids grow by output + tool turn).

The HTTP client is a minimal HTTP/1.1 keep-alive client on asyncio streams, one connection per
worker: a general client such as httpx costs around a millisecond of CPU per request, which on
a small machine would be charged against every target and blur the differences being measured.
Every loop is bounded in count (sessions x turns) and in time (``deadline_s``, per-request timeout).
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import time

import orjson


FAILURES = (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError, KeyError)


class Conn:
    """One keep-alive HTTP/1.1 connection; reopened when the server closes it."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.r: asyncio.StreamReader | None = None
        self.w: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        for attempt in (0, 1):
            if self.w is None:
                self.r, self.w = await asyncio.open_connection(self.host, self.port)
            try:
                return await self._post(path, body, headers)
            except (ConnectionError, asyncio.IncompleteReadError):
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    async def _post(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n{extra}\r\n").encode()
        self.w.writelines((head, body))  # as the engine transport does: uvloop writes both with one writev, no copy
        await self.w.drain()
        raw = await self.r.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        hdrs = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
        if "content-length" in hdrs:
            data = await self.r.readexactly(int(hdrs["content-length"]))
        elif hdrs.get("transfer-encoding", "").lower() == "chunked":
            parts = []
            while True:
                size = int((await self.r.readuntil(b"\r\n")).split(b";")[0], 16)
                chunk = await self.r.readexactly(size + 2)
                if size == 0:
                    break
                parts.append(chunk[:-2])
            data = b"".join(parts)
        else:
            data = await self.r.read()
            self.close()
        if hdrs.get("connection", "").lower() == "close":
            self.close()
        return status, data

    def close(self) -> None:
        if self.w is not None:
            self.w.close()
        self.r = self.w = None


async def run(spec: dict) -> dict:
    host, port = spec["host"], spec["port"]
    mode, c, spw, turns = spec["mode"], spec["c"], spec["sessions_per_worker"], spec["turns"]
    deadline = time.perf_counter() + spec["deadline_s"]
    timeout = spec.get("request_timeout_s", 30.0)
    lat: list[float] = []
    errors: list[str] = []
    sessions = 0

    def chat_start(name: str) -> dict:
        headers = {"X-Session-Id": name} if spec.get("session_header") else {}
        headers.update(spec.get("headers") or {})
        return {"msgs": [dict(m) for m in spec["messages"]], "headers": headers, "t": 0}

    async def chat_turn(conn: Conn, st: dict, record: bool = True) -> bool:
        """One turn of a chat session; False when the session cannot go on."""
        body = orjson.dumps({"model": spec["model"], "messages": st["msgs"], "tools": spec["tools"], "max_tokens": 512})
        t0 = time.perf_counter()
        status, data = await asyncio.wait_for(conn.post("/v1/chat/completions", body, st["headers"]), timeout)
        dt = time.perf_counter() - t0
        if status != 200:
            errors.append(f"{status}: {data[:200]!r}")
            return False
        m = orjson.loads(data)["choices"][0]["message"]
        calls = m.get("tool_calls") or []
        if not calls:
            errors.append(f"no tool call in reply: {data[:200]!r}")
            return False
        if record:
            lat.append(dt)
        st["msgs"].append({k: v for k, v in m.items() if v is not None})
        st["msgs"].append({"role": "tool", "tool_call_id": calls[0]["id"], "content": f'{{"step": {st["t"]}, "ok": true}}'})
        st["t"] += 1
        return True

    async def chat_session(conn: Conn, name: str) -> None:
        st = chat_start(name)
        for _ in range(turns):
            if time.perf_counter() > deadline or not await chat_turn(conn, st):
                return

    async def generate_session(conn: Conn, name: str) -> None:
        ids = list(spec["prompt_ids"])
        for t in range(turns):
            if time.perf_counter() > deadline:
                return
            body = orjson.dumps({
                "input_ids": ids, "rid": f"{name}-{t}", "stream": False, "return_logprob": True, "logprob_start_len": -1,
                "sampling_params": {"max_new_tokens": 512, "temperature": 1.0, "skip_special_tokens": False, "no_stop_trim": True},
            })
            t0 = time.perf_counter()
            status, data = await asyncio.wait_for(conn.post("/generate", body, {}), timeout)
            dt = time.perf_counter() - t0
            if status != 200:
                errors.append(f"{status}: {data[:200]!r}")
                return
            got = [int(x[1]) for x in orjson.loads(data)["meta_info"]["output_token_logprobs"]]
            lat.append(dt)
            ids = ids + got + spec["tail_ids"]

    session = generate_session if mode == "generate" else chat_session
    stall_lat: list[float] = []

    workers_done = False

    async def staller(stall: dict) -> None:
        """Beside the workers: a fresh session whose first turn carries a long text, every
        ``pause_s``; a new text each time (a number in front), so each is rendered from scratch.
        Stops when the workers are done: Python 3.11's ``wait_for`` can swallow the cancel that
        lands as its request completes, so the loop checks the flag as well."""
        conn = Conn(host, port)
        try:
            for k in itertools.count(1):
                if workers_done:
                    return
                body = orjson.dumps({"model": spec["model"], "messages": [{"role": "user", "content": f"{k} {stall['text']}"}]})
                t0 = time.perf_counter()
                async with asyncio.timeout(600):
                    status, data = await conn.post("/v1/chat/completions", body, {})
                if status != 200:
                    errors.append(f"long first turn: {status}: {data[:200]!r}")
                    return
                stall_lat.append(time.perf_counter() - t0)
                await asyncio.sleep(stall["pause_s"])
        finally:
            conn.close()

    async def worker(w: int) -> None:
        nonlocal sessions
        conn = Conn(host, port)
        try:
            for s in range(spw):
                if time.perf_counter() > deadline:
                    return
                try:
                    await session(conn, f"{spec.get('tag', 'bench')}-{w}-{s}")
                    sessions += 1
                except FAILURES as e:
                    errors.append(f"{type(e).__name__}: {e}")
                    conn.close()
        finally:
            conn.close()

    if spec.get("warm_first"):  # first turns untimed, then wait for "go" on stdin (the caller reads CPU between)
        conns = [Conn(host, port) for _ in range(c)]
        states: list[list[dict]] = [[] for _ in range(c)]

        async def first(w: int) -> None:
            for s in range(spw):
                st = chat_start(f"{spec.get('tag', 'bench')}-{w}-{s}")
                try:
                    if await chat_turn(conns[w], st, record=False):
                        states[w].append(st)
                except FAILURES as e:
                    errors.append(f"{type(e).__name__}: {e}")
                    conns[w].close()

        await asyncio.gather(*(first(w) for w in range(c)))
        sys.stderr.write("READY\n")
        sys.stderr.flush()
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
        deadline = time.perf_counter() + spec["deadline_s"]

        async def rest(w: int) -> None:
            nonlocal sessions
            for st in states[w]:
                try:
                    for _ in range(turns - 1):
                        if time.perf_counter() > deadline or not await chat_turn(conns[w], st):
                            break
                    sessions += 1
                except FAILURES as e:
                    errors.append(f"{type(e).__name__}: {e}")
                    conns[w].close()
            conns[w].close()

        t0, cpu0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(rest(w) for w in range(c)))
    else:
        t0, cpu0 = time.perf_counter(), time.process_time()
        beside = asyncio.ensure_future(staller(spec["stall"])) if spec.get("stall") else None
        await asyncio.gather(*(worker(w) for w in range(c)))
        workers_done = True
        if beside is not None:
            beside.cancel()
            await asyncio.gather(beside, return_exceptions=True)
    # CPU of the request loops only (not interpreter start-up), to show how much of the cores it took.
    return {"lat": lat, "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - cpu0, "sessions": sessions,
            "errors": errors, "timed_out": time.perf_counter() > deadline, "stall_lat": stall_lat}


if __name__ == "__main__":
    with open(sys.argv[1], "rb") as f:
        spec = orjson.loads(f.read())
    try:
        import uvloop  # noqa: F401  (cheaper event loop when available)

        uvloop.install()
    except ImportError:
        pass
    sys.stdout.buffer.write(orjson.dumps(asyncio.run(run(spec))))
