"""``splice bench overhead``: latency Splice adds in front of a zero-latency SGLang ``/generate``.

A stand-in process answers ``/generate`` instantly with fixed tokens and logprobs (an assistant
turn with a ``<think>`` block and one tool call, closed by ``<|im_end|>``). A load generator runs
C concurrent multi-turn sessions with httpx against (a) the stand-in directly, in token space, and
(b) ``splice serve --engine sglang`` in front of it, over ``/v1/chat/completions``.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

_STANDIN = r"""
import json, sys
import orjson, uvicorn
port = int(sys.argv[1]); out_ids = json.loads(sys.argv[2]); stop_id = int(sys.argv[3])
triples = [[-0.5, t, None] for t in out_ids]

async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            m = await receive()
            if m["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif m["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"}); return
    body = b""
    while True:
        m = await receive()
        body += m.get("body", b"")
        if not m.get("more_body"):
            break
    path = scope["path"]
    if path == "/generate":
        req = orjson.loads(body)
        n = len(req.get("input_ids") or [])
        out = {"text": "", "output_ids": out_ids, "meta_info": {
            "id": req.get("rid", "r"), "finish_reason": {"type": "stop", "matched": stop_id},
            "prompt_tokens": n, "completion_tokens": len(out_ids), "cached_tokens": 0,
            "weight_version": "0", "input_token_logprobs": [], "output_token_logprobs": triples,
            "e2e_latency": 0.0}}
    elif path in ("/model_info", "/get_model_info"):
        out = {"model_path": "/standin", "is_generation": True, "weight_version": "0"}
    else:
        out = {"success": True}
    data = orjson.dumps(out)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})

uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
"""


def add_parser(sub) -> None:
    p = sub.add_parser("overhead", help="latency Splice adds in front of a zero-latency SGLang stand-in")
    p.add_argument("--concurrency", "-c", type=int, nargs="+", default=[1, 8])
    p.add_argument("--turns", type=int, default=15, help="turns per session")
    p.add_argument("--sessions-per-worker", type=int, default=2)
    p.add_argument("--out")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, timeout: float = 90.0) -> None:
    import httpx

    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"process for {url} exited with {proc.returncode}")
        try:
            httpx.get(url, timeout=1.0)
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise SystemExit(f"{url} did not come up in {timeout}s")


def _stats(lat: list[float], wall: float) -> dict:
    lat = sorted(lat)
    q = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))]  # noqa: E731
    return {
        "turns": len(lat),
        "wall_s": wall,
        "turns_per_s": len(lat) / wall,
        "p50_ms": q(0.50) * 1e3,
        "p99_ms": q(0.99) * 1e3,
        "mean_ms": statistics.fmean(lat) * 1e3,
    }


async def _run_direct(url: str, c: int, spw: int, turns: int, prompt0: list[int], out_ids: list[int], tail: list[int]):
    import httpx

    lat: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=60.0, limits=httpx.Limits(max_connections=c)) as cl:

        async def worker(w: int):
            for s in range(spw):
                ids = list(prompt0)
                for t in range(turns):
                    body = {
                        "input_ids": ids,
                        "sampling_params": {"max_new_tokens": 512, "temperature": 1.0, "skip_special_tokens": False, "no_stop_trim": True},
                        "return_logprob": True,
                        "logprob_start_len": -1,
                        "rid": f"{w}-{s}-{t}",
                        "stream": False,
                    }
                    t0 = time.perf_counter()
                    r = await cl.post("/generate", json=body)
                    r.raise_for_status()
                    got = [int(x[1]) for x in r.json()["meta_info"]["output_token_logprobs"]]
                    lat.append(time.perf_counter() - t0)
                    ids = ids + got + tail

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(c)))
        return lat, time.perf_counter() - t0


async def _run_splice(url: str, c: int, spw: int, turns: int, tools: list[dict]):
    import httpx

    lat: list[float] = []
    errors: list[str] = []
    async with httpx.AsyncClient(base_url=url, timeout=60.0, limits=httpx.Limits(max_connections=c)) as cl:

        async def worker(w: int):
            for s in range(spw):
                sid = f"bench-{w}-{s}-{time.time_ns()}"
                msgs: list[dict] = [
                    {"role": "system", "content": "You are a careful agent. Use the tool f to make progress."},
                    {"role": "user", "content": "Run the computation until it reaches the end, one step at a time."},
                ]
                for t in range(turns):
                    body = {"model": "splice-model", "messages": msgs, "tools": tools, "max_tokens": 512}
                    t0 = time.perf_counter()
                    r = await cl.post("/v1/chat/completions", json=body, headers={"X-Session-Id": sid})
                    dt = time.perf_counter() - t0
                    if r.status_code != 200:
                        errors.append(f"{r.status_code}: {r.text[:200]}")
                        return
                    lat.append(dt)
                    m = r.json()["choices"][0]["message"]
                    msgs.append(m)
                    calls = m.get("tool_calls") or []
                    if not calls:
                        errors.append("no tool call in reply")
                        return
                    msgs.append({"role": "tool", "tool_call_id": calls[0]["id"], "content": json.dumps({"step": t, "ok": True})})

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(c)))
        return lat, time.perf_counter() - t0, errors


def run(args) -> dict:
    from tokenization import ChatFormat, Message, Tool, load_tokenizer, qwen3_tokenizer_dir

    from .bench import _table

    tok_dir = str(qwen3_tokenizer_dir())
    tok = load_tokenizer(tok_dir)
    cf = ChatFormat(tok, "qwen3")
    text = '<think>\nI should call f.\n</think>\n\n<tool_call>\n{"name":"f","arguments":{"x":1}}\n</tool_call><|im_end|>'
    out_ids = list(tok.encode(text, add_special_tokens=False))
    stop_id = tok.convert_tokens_to_ids("<|im_end|>")
    tool_spec = {"name": "f", "description": "Advance the computation by one step.",
                 "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}
    tools = [Tool(**tool_spec)]
    prompt0 = cf.render(
        [Message(role="system", content="You are a careful agent. Use the tool f to make progress."),
         Message(role="user", content="Run the computation until it reaches the end, one step at a time.")],
        tools,
    )
    tail = list(tok.encode('\n<|im_start|>user\n<tool_response>\n{"step": 0, "ok": true}\n</tool_response><|im_end|>\n<|im_start|>assistant\n', add_special_tokens=False))

    procs: list[subprocess.Popen] = []
    tmp = tempfile.mkdtemp(prefix="splice_bench_overhead_")
    try:
        sport = _free_port()
        procs.append(subprocess.Popen([sys.executable, "-c", _STANDIN, str(sport), json.dumps(out_ids), str(stop_id)]))
        surl = f"http://127.0.0.1:{sport}"
        _wait_http(surl + "/health", procs[-1])
        pport = _free_port()
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", "import sys; from proxy.cli import main; sys.exit(main(sys.argv[1:]))",
                 "serve", "--engine", "sglang", "--engine-url", surl, "--tokenizer", tok_dir, "--renderer", "qwen3",
                 "--store", os.path.join(tmp, "splice.sqlite"), "--host", "127.0.0.1", "--port", str(pport)],
                env=env,
            )
        )
        purl = f"http://127.0.0.1:{pport}"
        _wait_http(purl + "/v1/models", procs[-1])

        spw, turns = args.sessions_per_worker, args.turns
        ftools = [{"type": "function", "function": tool_spec}]
        # warm-up (connections, caches, first-request costs)
        asyncio.run(_run_direct(surl, 2, 1, 3, prompt0, out_ids, tail))
        asyncio.run(_run_splice(purl, 2, 1, 3, ftools))
        runs = []
        for c in args.concurrency:
            lat_d, wall_d = asyncio.run(_run_direct(surl, c, spw, turns, prompt0, out_ids, tail))
            lat_s, wall_s, errors = asyncio.run(_run_splice(purl, c, spw, turns, ftools))
            runs.append((c, _stats(lat_d, wall_d), _stats(lat_s, wall_s) if lat_s else None, errors))
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
    rows, out_runs = [], []
    for c, d, s, errors in runs:
        rows.append([c, "(a) stand-in direct, /generate", f"{d['turns_per_s']:.0f}", f"{d['p50_ms']:.2f}", f"{d['p99_ms']:.2f}"])
        if s:
            rows.append([c, "(b) Splice, /v1/chat/completions", f"{s['turns_per_s']:.0f}", f"{s['p50_ms']:.2f}", f"{s['p99_ms']:.2f}"])
            rows.append([c, "added by Splice", "", f"{s['p50_ms'] - d['p50_ms']:.2f}", f"{s['p99_ms'] - d['p99_ms']:.2f}"])
        out_runs.append({"concurrency": c, "direct": d, "splice": s, "errors": errors[:5],
                         "added_p50_ms": (s["p50_ms"] - d["p50_ms"]) if s else None,
                         "added_p99_ms": (s["p99_ms"] - d["p99_ms"]) if s else None})
    print(f"Overhead: C concurrent sessions x {spw} sessions each x {turns} turns, zero-latency SGLang stand-in, "
          f"{len(out_ids)} output tokens/turn; stand-in, Splice and load generator share this machine's {os.cpu_count()} cores")
    print(_table(["C", "target", "turns/s", "p50 ms", "p99 ms"], rows))
    for c, _d, _s, errors in runs:
        if errors:
            print(f"C={c}: {len(errors)} failed sessions; first: {errors[0]}")
    print("LiteLLM: not measured (not installed here).")
    return {"bench": "overhead", "sessions_per_worker": spw, "turns_per_session": turns,
            "output_tokens_per_turn": len(out_ids), "runs": out_runs,
            "litellm": "skipped (not installed)", "cpu_count": os.cpu_count()}
