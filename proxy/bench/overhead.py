"""``splice bench overhead``: what a proxy adds in front of a zero-latency engine.

Three processes besides this one, so that each one's CPU can be read on its own:

* the engine stand-in (``standin.py``): SGLang ``/generate`` and OpenAI ``/v1/chat/completions``
  answered instantly with a fixed assistant turn carrying one tool call;
* the proxies: Splice (``splice serve --engine sglang``) and, when it can be installed, LiteLLM's
  proxy (in its own venv under ``~/.cache/splice``, never in the project's), both in front of it;
* the load generator (``loadgen.py``), a fresh process per phase, running C concurrent
  multi-turn tool-using sessions.

For each concurrency level the targets are measured back to back (interleaved), so drift in the
machine's state affects all of them alike. Around each phase we read the proxy's CPU time from
``/proc`` and, for Splice, its ``/metrics`` histograms, and report deltas per turn.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from engines.reference.launch import free_port

from .profile import start_profile, stop_profile, top_frames
from .stack import reply_ids, start_splice, start_standin, wait_http
from .tables import format_table as _table
from .workload import SYSTEM, TOOL, USER

HERE = Path(__file__).resolve().parent
LITELLM_VENV = Path.home() / ".cache" / "splice" / "bench-venv-litellm"
STAGES = ("bridge", "render", "parse", "commit")


def add_parser(sub) -> None:
    p = sub.add_parser("overhead", help="latency and CPU Splice (and LiteLLM) add in front of a zero-latency engine")
    p.add_argument("--concurrency", "-c", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--turns", type=int, default=12, help="turns per session at low C (fewer at high C, at least 4)")
    p.add_argument("--min-turns", type=int, default=300, help="turns per phase to aim for (sets sessions per worker)")
    p.add_argument("--phase-timeout", type=float, default=45.0, help="seconds after which a phase starts no new turns")
    p.add_argument("--no-litellm", action="store_true", help="skip LiteLLM (no install, no start)")
    p.add_argument("--history", type=int, nargs="*", default=[], metavar="TOKENS",
                   help="long-session phases: turns on top of this many tokens of history (e.g. 10000 100000), "
                        "header-less so the history is matched, beside the same turns on a short history")
    p.add_argument("--history-turns", type=int, default=8, help="turns per long session (the first, untimed, carries the history)")
    p.add_argument("--history-sessions", type=int, default=3, help="long sessions per phase (one at a time)")
    p.add_argument("--history-rounds", type=int, default=6,
                   help="with --history: then rounds of alternating blocks, 4 turns of fresh sessions of every size "
                        "(--history-sessions each), for a ratio to the short history measured at the same moments (0: none)")
    p.add_argument("--growth", type=int, default=0, metavar="TURNS",
                   help="session-growth phase: CPU per turn on sessions grown to TURNS turns of short messages "
                        "against fresh ones, in alternating blocks")
    p.add_argument("--growth-sessions", type=int, default=5, help="sessions of each kind in the growth phase")
    p.add_argument("--growth-rounds", type=int, default=10, help="rounds of alternating blocks in the growth phase")
    p.add_argument("--growth-api", nargs="+", choices=("chat", "responses", "messages"), default=["chat"],
                   help="the API(s) the growth phase's sessions use (responses: the whole input list every turn; "
                        "messages: Anthropic's, a cache_control marker moved every turn)")
    p.add_argument("--stall", type=int, default=0, metavar="TOKENS",
                   help="short turns at --stall-c alone, then beside a fresh session's first turn of TOKENS tokens "
                        "(rendered in full) every --stall-pause seconds: how far one long render delays everyone else")
    p.add_argument("--stall-c", type=int, default=8, help="concurrency of the short turns in the --stall phases")
    p.add_argument("--stall-pause", type=float, default=0.25, help="seconds between long first turns in the --stall phase")
    p.add_argument("--reasoning-tokens", type=int, default=0, metavar="N",
                   help="the stand-in's reply thinks about N tokens longer (default 0: 24 tokens in all), for what "
                        "the proxy spends per output token")
    p.add_argument("--profile", metavar="PREFIX",
                   help="sample Splice with py-spy during its phases: PREFIX-cC.txt (collapsed stacks) and the top frames printed")
    p.add_argument("--profile-gil", action="store_true",
                   help="with --profile: sample only the thread holding the GIL (Python's own work; in a VM py-spy's "
                        "idle detection counts some waits as work)")
    p.add_argument("--out")


# ---------------------------------------------------------------- processes


def _cpu_seconds(pid: int) -> float:
    """CPU seconds of ``pid``, its reaped children, and its live descendants (uvicorn/gunicorn workers)."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, list[str]]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                raw = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            f = raw[raw.rindex(")") + 2:].split()
            stats[int(d)] = (int(f[1]), f)  # (ppid, fields after the command name)
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        if p not in stats:
            continue
        f = stats[p][1]
        try:  # the process's own CPU clock, all its threads (exited ones too), to the nanosecond
            total += time.clock_gettime(((~p) << 3) | 2)  # Linux: MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)
        except OSError:  # utime stime: 10 ms ticks (a phase of 120 turns at 1.5 ms each reads +-6%)
            total += (int(f[11]) + int(f[12])) / tick
        total += (int(f[13]) + int(f[14])) / tick  # cutime cstime: reaped children
        todo += [q for q, (pp, _) in stats.items() if pp == p]
    return total


_METRIC = re.compile(r'^(splice_(?:stage|engine|proxy)_seconds|splice_commit_group_turns)_(sum|count)(?:\{stage="(\w+)"\})? ([0-9.eE+-]+)$')


def _splice_metrics(url: str) -> dict[str, float]:
    """``{"bridge_sum": s, "bridge_count": n, ..., "engine_sum": ..., "proxy_count": ...}`` from Prometheus text."""
    import httpx

    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10.0).text.splitlines():
        m = _METRIC.match(line)
        if m:
            name, kind, stage, val = m.groups()
            key = stage or ("group" if name == "splice_commit_group_turns" else name.split("_")[1])
            out[f"{key}_{kind}"] = float(val)
    return out


def _stage_ms(m0: dict[str, float], m1: dict[str, float]) -> dict[str, float | None]:
    """Mean ms per observation of each Splice stage between two ``/metrics`` reads, and the mean
    turns per store transaction (``group``: the group commit's size)."""
    def mean(k: str) -> float | None:
        dn = m1.get(f"{k}_count", 0) - m0.get(f"{k}_count", 0)
        return (m1.get(f"{k}_sum", 0) - m0.get(f"{k}_sum", 0)) / dn if dn else None

    out = {k: None if (v := mean(k)) is None else v * 1e3 for k in (*STAGES, "engine", "proxy")}
    return {**out, "group": mean("group")}


def _litellm_start(tmp: str, upstream: str, key: str, procs: list) -> tuple[str | None, subprocess.Popen | None, str]:
    """(url, process, note). Installs LiteLLM into its own venv on first use; url is None when it cannot run."""
    exe = LITELLM_VENV / "bin" / "litellm"
    if not exe.exists():
        print(f"installing LiteLLM into {LITELLM_VENV} (first use only) ...", flush=True)
        try:
            LITELLM_VENV.parent.mkdir(parents=True, exist_ok=True)
            subprocess.run([shutil.which("python3") or "python3", "-m", "venv", str(LITELLM_VENV)], check=True, capture_output=True)
            subprocess.run([str(LITELLM_VENV / "bin" / "pip"), "install", "-q", "litellm[proxy]"],
                           check=True, capture_output=True, timeout=900)
        except (subprocess.SubprocessError, OSError) as e:
            err = getattr(e, "stderr", b"") or b""
            return None, None, f"install failed: {e} {err.decode(errors='replace')[-300:]}"
    cfg = os.path.join(tmp, "litellm.yaml")
    with open(cfg, "w") as f:
        f.write(
            "model_list:\n"
            "  - model_name: standin\n"
            "    litellm_params:\n"
            "      model: openai/standin\n"
            f"      api_base: {upstream}/v1\n"
            "      api_key: dummy\n"
            "litellm_settings:\n"
            "  telemetry: false\n"
            "  drop_params: true\n"
            "  turn_off_message_logging: true\n"
            "general_settings:\n"
            "  disable_spend_logs: true\n"
            "  disable_error_logs: true\n"
        )
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "PYTHONPATH", "VIRTUAL_ENV")}
    # No DB, no remote cost-map fetch, errors only on the console.
    env.update(LITELLM_LOG="ERROR", LITELLM_LOCAL_MODEL_COST_MAP="True", DISABLE_SCHEMA_UPDATE="true")
    # It refuses to start without a strong master key; a fresh one per run, sent by the load generator.
    env["LITELLM_MASTER_KEY"] = key
    log = open(os.path.join(tmp, "litellm.log"), "wb")
    proc = subprocess.Popen([str(exe), "--config", cfg, "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    procs.append(proc)
    url = f"http://127.0.0.1:{port}"
    why = wait_http(url + "/health/liveliness", proc, timeout=120.0)
    if why:
        tail = Path(log.name).read_text(errors="replace")[-400:]
        return None, proc, f"did not start ({why}): {tail}"
    version = subprocess.run([str(LITELLM_VENV / "bin" / "pip"), "show", "litellm"], capture_output=True, text=True).stdout
    ver = next((ln.split(":", 1)[1].strip() for ln in version.splitlines() if ln.startswith("Version:")), "?")
    return url, proc, f"litellm {ver}"


# ---------------------------------------------------------------- phases


def _shape(c: int, args) -> tuple[int, int]:
    """(turns per session, sessions per worker): fewer turns at high C so C=256 stays bounded."""
    turns = max(4, min(args.turns, 640 // c))
    spw = max(1, math.ceil(args.min_turns / (c * turns)))
    return turns, spw


def _loadgen(spec: dict, tmp: str, timeout: float) -> dict:
    path = os.path.join(tmp, "loadgen.json")
    with open(path, "w") as f:
        json.dump(spec, f)
    r = subprocess.run([sys.executable, str(HERE / "loadgen.py"), path], capture_output=True, timeout=timeout)
    if r.returncode:
        return {"lat": [], "wall_s": 0.0, "cpu_s": 0.0, "sessions": 0, "errors": [r.stderr.decode(errors="replace")[-400:]]}
    return json.loads(r.stdout)


def quantile(lat: list[float], p: float) -> float:
    """The ``p`` quantile of ``lat``, sorted: the value at rank ``int(p * n)``, not interpolated
    (how every latency row of the benches is read)."""
    return lat[min(len(lat) - 1, int(p * len(lat)))]


def _stats(res: dict) -> dict:
    lat = sorted(res["lat"])
    if not lat:
        return {"turns": 0, "errors": res["errors"][:5], "n_errors": len(res["errors"])}
    q = lambda p: quantile(lat, p)  # noqa: E731
    out = {"turns": len(lat), "sessions": res["sessions"], "wall_s": res["wall_s"], "turns_per_s": len(lat) / res["wall_s"],
           "p50_ms": q(0.50) * 1e3, "p99_ms": q(0.99) * 1e3, "max_ms": lat[-1] * 1e3, "mean_ms": sum(lat) / len(lat) * 1e3,
           "n_errors": len(res["errors"]), "errors": res["errors"][:5], "timed_out": res.get("timed_out", False)}
    if stall := res.get("stall_lat"):  # the long first turns sent beside them (--stall)
        out["stall_turns"], out["stall_mean_ms"] = len(stall), sum(stall) / len(stall) * 1e3
    return out


def _phase(target: dict, c: int, turns: int, spw: int, base: dict, tmp: str, deadline: float, standin_pid: int,
           profile: str | None = None, gil: bool = False) -> dict:
    """One target at one C: load generator run, with proxy CPU and Splice metrics read around it.

    The stand-in's and the load generator's CPU are recorded too: on a small machine they compete
    with the proxy for cores, which is what bounds the high-C numbers.
    """
    spec = {**base, **target["spec"], "c": c, "turns": turns, "sessions_per_worker": spw, "deadline_s": deadline,
            "tag": f"{target['key']}-c{c}-{time.time_ns()}"}
    pid = target.get("pid")
    murl = target.get("metrics_url")
    cpu0, sb0 = (_cpu_seconds(pid) if pid else None), _cpu_seconds(standin_pid)
    m0 = _splice_metrics(murl) if murl else None
    spy = start_profile(pid, f"{profile}-c{c}.txt", gil=gil) if profile and murl else None
    res = _loadgen(spec, tmp, timeout=deadline + 120)
    if spy is not None:
        stop_profile(spy)
    cpu1, sb1 = (_cpu_seconds(pid) if pid else None), _cpu_seconds(standin_pid)
    m1 = _splice_metrics(murl) if murl else None
    st = _stats(res)
    if st["turns"]:
        st["standin_cpu_ms_per_turn"] = (sb1 - sb0) / st["turns"] * 1e3
        st["loadgen_cpu_ms_per_turn"] = res["cpu_s"] / st["turns"] * 1e3
    if pid and st["turns"]:
        st["cpu_s"] = cpu1 - cpu0
        st["cpu_ms_per_turn"] = (cpu1 - cpu0) / st["turns"] * 1e3
    if murl and st["turns"]:
        st["splice_ms_per_turn"] = _stage_ms(m0, m1)
    return st


def _document(tok, n_tokens: int) -> str:
    """About ``n_tokens`` tokens of varied prose and numbers (deterministic): a long tool result."""
    import random

    if n_tokens <= 0:
        return ""
    rng = random.Random(0)
    words = ("the kernel returns a tensor when its input is ready and otherwise waits for the next batch of "
             "requests from agents that call tools read files write patches run tests").split()  # fmt: skip
    chunk = " ".join(rng.choice(words) if k % 7 else str(rng.randrange(10**6)) for k in range(2000))
    per_word = len(tok.encode(chunk, add_special_tokens=False)) / 2000
    text = " ".join(rng.choice(words) if k % 7 else str(rng.randrange(10**6)) for k in range(int(n_tokens / per_word)))
    return text


def _warm_phase(target: dict, spec: dict, tmp: str, timeout: float, profile: str | None = None, gil: bool = False) -> dict:
    """A long-session phase: the load generator sends every session's first turn (the history),
    waits, and the proxy's CPU and metrics are read around the turns after it only."""
    import threading

    path = os.path.join(tmp, "loadgen-warm.json")
    with open(path, "w") as f:
        json.dump({**spec, "warm_first": True}, f)
    proc = subprocess.Popen([sys.executable, str(HERE / "loadgen.py"), path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)  # fmt: skip
    killer = threading.Timer(timeout, proc.kill)
    killer.start()
    try:
        ready = proc.stderr.readline()
        if ready.strip() != b"READY":
            proc.kill()
            return {"lat": [], "wall_s": 0.0, "cpu_s": 0.0, "sessions": 0, "errors": [(ready + proc.stderr.read()).decode(errors="replace")[-400:]]}
        pid, murl = target["pid"], target["metrics_url"]
        cpu0, m0 = _cpu_seconds(pid), _splice_metrics(murl)
        spy = start_profile(pid, profile, gil=gil) if profile else None
        out, err = proc.communicate(b"go\n")
        if spy is not None:
            stop_profile(spy)
        cpu1, m1 = _cpu_seconds(pid), _splice_metrics(murl)
    finally:
        killer.cancel()
    if proc.returncode:
        return {"lat": [], "wall_s": 0.0, "cpu_s": 0.0, "sessions": 0, "errors": [err.decode(errors="replace")[-400:]]}
    st = _stats(json.loads(out))
    if st["turns"]:
        st["cpu_ms_per_turn"] = (cpu1 - cpu0) / st["turns"] * 1e3
        st["splice_ms_per_turn"] = _stage_ms(m0, m1)
    return st


def _history_target(tmp: str, engine_url: str, tok_dir: str, procs: list) -> dict:
    """A second Splice for the long-session phases, with ``--drift-check off``: a drift check is a
    full re-render in the background, paid from a token budget, so short sessions get checked
    and long ones mostly not; with it on, the rows would compare different work."""
    hist_tmp = os.path.join(tmp, "history")
    os.makedirs(hist_tmp)
    port = start_splice(hist_tmp, engine_url, tok_dir, procs, extra=["--drift-check", "off"])
    url = f"http://127.0.0.1:{port}"
    if why := wait_http(url + "/v1/models", procs[-1]):
        raise SystemExit(f"splice serve (history phases): {why}")
    return {"key": "splice_history", "label": "(b) Splice, --drift-check off", "pid": procs[-1].pid, "metrics_url": url,
            "spec": {"mode": "chat", "port": port, "model": "splice-model"}}


def _history_phases(args, tok, base: dict, target: dict, tmp: str) -> list[dict]:
    rows = []
    for n in [0, *args.history]:
        doc = _document(tok, n)
        msgs = [dict(m) for m in base["messages"]]
        if doc:
            msgs[-1]["content"] = msgs[-1]["content"] + "\n\nThe file to work on:\n" + doc
        spec = {**base, **target["spec"], "messages": msgs, "session_header": False, "c": 1, "turns": args.history_turns,
                "sessions_per_worker": args.history_sessions, "deadline_s": args.phase_timeout, "tag": f"hist{n}-{time.time_ns()}"}
        print(f"history {n:,} tokens: {args.history_sessions} session(s) x {args.history_turns} turns (first untimed) ...", flush=True)
        prof = f"{args.profile}-h{n}.txt" if args.profile else None
        st = _warm_phase(target, spec, tmp, timeout=args.phase_timeout + 600, profile=prof, gil=args.profile_gil)
        if prof:
            print(top_frames(prof), flush=True)
        st["history_tokens"] = n
        st["history_tokens_measured"] = len(tok.encode(msgs[-1]["content"], add_special_tokens=False)) if doc else 0
        rows.append(st)
    return rows


# ---------------------------------------------------------------- run


def run(args) -> dict:
    from tokenization import ChatFormat, Message, Tool, load_tokenizer, qwen3_tokenizer_dir

    tok_dir = str(qwen3_tokenizer_dir())
    tok = load_tokenizer(tok_dir)
    cf = ChatFormat(tok, "qwen3")
    out_ids = reply_ids(tok, args.reasoning_tokens)
    prompt_ids = cf.render([Message(role="system", content=SYSTEM), Message(role="user", content=USER)], [Tool(**TOOL)])
    tail_ids = list(tok.encode('\n<|im_start|>user\n<tool_response>\n{"step": 0, "ok": true}\n</tool_response><|im_end|>\n'
                               "<|im_start|>assistant\n", add_special_tokens=False))
    base = {"host": "127.0.0.1", "prompt_ids": prompt_ids, "tail_ids": tail_ids,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}],
            "tools": [{"type": "function", "function": TOOL}]}

    procs: list[subprocess.Popen] = []
    tmp = tempfile.mkdtemp(prefix="splice_bench_overhead_")
    runs: list[dict] = []
    history: list[dict] = []
    history_ab: dict | None = None
    growth: list[dict] = []
    stall: list[dict] = []
    litellm_note = "skipped (--no-litellm)"
    try:
        surl = start_standin(tmp, tok, out_ids, procs)
        sport = int(surl.rsplit(":", 1)[1])
        pport = start_splice(tmp, surl, tok_dir, procs)
        splice = procs[-1]
        purl = f"http://127.0.0.1:{pport}"

        lurl = lproc = None
        lkey = "sk-" + secrets.token_hex(32)
        if not args.no_litellm:
            lurl, lproc, litellm_note = _litellm_start(tmp, surl, lkey, procs)
            if not lurl:
                print(f"LiteLLM: {litellm_note}; continuing without it.", flush=True)
        if why := wait_http(purl + "/v1/models", splice):
            raise SystemExit(f"splice serve: {why}")

        targets = [
            {"key": "direct_generate", "label": "(a) stand-in /generate", "spec": {"mode": "generate", "port": sport}},
            {"key": "direct_chat", "label": "(a) stand-in /v1/chat", "spec": {"mode": "chat", "port": sport, "model": "standin"}},
            {"key": "splice", "label": "(b) Splice", "pid": splice.pid, "metrics_url": purl,
             "spec": {"mode": "chat", "port": pport, "model": "splice-model", "session_header": True}},
        ]
        if lurl:
            targets.append({"key": "litellm", "label": "(c) LiteLLM", "pid": lproc.pid,
                            "spec": {"mode": "chat", "port": int(lurl.rsplit(":", 1)[1]), "model": "standin",
                                     "headers": {"Authorization": f"Bearer {lkey}"}}})
        for t in targets:  # warm-up: connections, imports on first request, caches
            w = _phase(t, 4, 3, 2, base, tmp, 30.0, procs[0].pid)
            if not w["turns"]:
                print(f"warm-up of {t['label']} failed: {w['errors'][:1]}", flush=True)

        for c in args.concurrency:
            turns, spw = _shape(c, args)
            print(f"C={c}: {spw} session(s)/worker x {turns} turns ...", flush=True)
            row = {"concurrency": c, "turns_per_session": turns, "sessions_per_worker": spw}
            for t in targets:
                row[t["key"]] = _phase(t, c, turns, spw, base, tmp, args.phase_timeout, procs[0].pid, args.profile,
                                    gil=args.profile_gil)
            if args.profile:
                print(top_frames(f"{args.profile}-c{c}.txt"), flush=True)
            for k in ("splice", "litellm"):
                s, ch, gen = row.get(k), row["direct_chat"], row["direct_generate"]
                if s and s["turns"] and ch["turns"] and gen["turns"]:
                    s["added_ms"] = {"p50_vs_chat": s["p50_ms"] - ch["p50_ms"], "p99_vs_chat": s["p99_ms"] - ch["p99_ms"],
                                     "p50_vs_generate": s["p50_ms"] - gen["p50_ms"], "p99_vs_generate": s["p99_ms"] - gen["p99_ms"]}
            runs.append(row)
        if args.stall:
            from .stall import stall_phases

            splice_target = next(t for t in targets if t["key"] == "splice")
            stall = stall_phases(args, splice_target, base, _document(tok, args.stall), tmp, procs[0].pid, _phase, _shape)
        second = _history_target(tmp, surl, tok_dir, procs) if args.history or args.growth else None
        history = _history_phases(args, tok, base, second, tmp) if args.history else []
        if args.history and args.history_rounds > 0:
            from .growth import run_history

            print(f"history, alternating blocks: {args.history_rounds} rounds ...", flush=True)
            history_ab = run_history(second["spec"]["port"], second["pid"], {n: _document(tok, n) for n in [0, *args.history]},
                                     args.history_sessions, args.history_rounds, _cpu_seconds)  # fmt: skip
        if args.growth:
            from .growth import run_growth

            for api in args.growth_api:
                print(f"growth ({api}): {args.growth_sessions} session(s) grown to {args.growth} turns, {args.growth_rounds} "
                      "rounds ...", flush=True)  # fmt: skip
                spy = start_profile(second["pid"], f"{args.profile}-growth-{api}.txt", gil=args.profile_gil) if args.profile else None
                try:
                    growth.append(run_growth(second["spec"]["port"], second["pid"], args.growth, args.growth_sessions,
                                             args.growth_rounds, _cpu_seconds, api))  # fmt: skip
                finally:
                    if spy is not None:
                        stop_profile(spy)
    finally:
        for p in reversed(procs):
            p.terminate()
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)

    _print(runs, targets, len(out_ids), litellm_note, _table)
    if stall:
        from .stall import print_stall

        print_stall(stall, args)
    if history:
        _print_history(history)
    if history_ab:
        from .growth import print_history

        print_history(history_ab, {r["history_tokens"]: r["history_tokens_measured"] for r in history})
    if growth:
        from .growth import print_growth

        for g in growth:
            print_growth(g)
    return {"bench": "overhead", "output_tokens_per_turn": len(out_ids), "cpu_count": os.cpu_count(), "history": history,
            "history_alternating": history_ab, "growth": growth, "stall": stall,
            "litellm": litellm_note, "targets": {t["key"]: t["label"] for t in targets}, "runs": runs,
            "method": "zero-latency stand-in; load generator, stand-in and each proxy in separate processes on one machine; "
                      "latency measured by the load generator; CPU from each process's CPU clock (+children) around "
                      "each phase; "
                      "Splice stages from /metrics sum/count deltas per phase"}


def _print_history(rows: list[dict]) -> None:
    short = rows[0].get("cpu_ms_per_turn")
    out = []
    for r in rows:
        if not r["turns"]:
            out.append([f"{r['history_tokens']:,}", "failed", "", "", "", "", "", "", ""])
            continue
        b = r.get("splice_ms_per_turn") or {}
        ratio = r["cpu_ms_per_turn"] / short if short else None
        out.append([f"{r['history_tokens_measured']:,}", r["turns"], _f(r["p50_ms"]), _f(r["p99_ms"]), _f(r["cpu_ms_per_turn"]),
                    _f(ratio), *(_f(b.get(k), "{:.3f}") for k in ("bridge", "parse", "commit"))])
    print("\nLong sessions, C=1, header-less (the history is matched), on a second Splice with --drift-check off (a "
          "budgeted background re-render that short sessions get and long ones mostly not): each session's first turn "
          "carries the history and is not timed; proxy CPU per later turn, against the short-history row.")
    print(_table(["history tokens", "turns", "p50 ms", "p99 ms", "proxy CPU ms/turn", "x short", "bridge", "parse", "commit"], out))
    for r in rows:
        if r.get("n_errors"):
            print(f"history {r['history_tokens']}: {r['n_errors']} errors; first: {r['errors'][0][:200]}")


def _f(x, fmt: str = "{:.2f}") -> str:
    return "" if x is None else fmt.format(x)


def _print(runs: list[dict], targets: list[dict], n_out: int, litellm_note: str, _table) -> None:
    rows = []
    for r in runs:
        c, chat = r["concurrency"], r["direct_chat"]
        for t in targets:
            s = r[t["key"]]
            if not s["turns"]:
                rows.append([c, t["label"], "failed", "", "", "", "", "", ""])
                continue
            proxied = t.get("pid") is not None and chat.get("turns")
            rows.append([
                c, t["label"], s["turns"], _f(s["turns_per_s"], "{:.0f}"), _f(s["p50_ms"]), _f(s["p99_ms"]),
                _f(s["p50_ms"] - chat["p50_ms"]) if proxied else "", _f(s["p99_ms"] - chat["p99_ms"]) if proxied else "",
                _f(s.get("cpu_ms_per_turn")),
            ])
    print(f"\nOverhead over a zero-latency engine stand-in ({n_out} output tokens/turn, one tool call per turn); "
          f"load generator, stand-in and proxies share this machine's {os.cpu_count()} cores.")
    print("added = proxy minus the stand-in's own /v1/chat/completions at the same C; CPU = proxy process (+children) per turn.")
    print(_table(["C", "target", "turns", "turns/s", "p50 ms", "p99 ms", "added p50", "added p99", "proxy CPU ms/turn"], rows))

    rows = []
    for r in runs:
        b = r["splice"].get("splice_ms_per_turn")
        if b:
            rows.append([r["concurrency"], *(_f(b[k], "{:.3f}") for k in (*STAGES, "proxy", "engine")), _f(b.get("group"))])
    if rows:
        print("\nSplice's own breakdown from /metrics, mean ms per turn (proxy = wall time minus engine time;"
              " turns/commit = turns per store transaction):")
        print(_table(["C", *STAGES, "proxy total", "engine", "turns/commit"], rows))
    rows = []
    for r in runs:
        for t in targets:
            s = r[t["key"]]
            if s["turns"]:
                rows.append([r["concurrency"], t["label"], _f(s.get("cpu_ms_per_turn")), _f(s["standin_cpu_ms_per_turn"]),
                             _f(s["loadgen_cpu_ms_per_turn"])])
    print("\nCPU ms per turn by process (they share the cores, so the sum per turn bounds turns/s):")
    print(_table(["C", "target", "proxy", "stand-in", "load generator"], rows))
    for r in runs:
        for t in targets:
            s = r[t["key"]]
            if s.get("n_errors"):
                print(f"C={r['concurrency']} {t['label']}: {s['n_errors']} errors; first: {s['errors'][0][:200]}")
            if s.get("timed_out"):
                print(f"C={r['concurrency']} {t['label']}: hit --phase-timeout; fewer turns than planned")
    _print_against_litellm(runs, _table)
    print(f"LiteLLM: {litellm_note}")


def _print_against_litellm(runs: list[dict], _table) -> None:
    """Splice over LiteLLM, same run: ratios carry across machines where absolute ms do not."""
    rows = []
    for r in runs:
        s, lt, chat = r.get("splice") or {}, r.get("litellm") or {}, r["direct_chat"]
        if not (s.get("turns") and lt.get("turns") and chat.get("turns")):
            continue
        cpu = (s.get("cpu_ms_per_turn") or 0) / (lt.get("cpu_ms_per_turn") or float("nan"))
        added = (s["p50_ms"] - chat["p50_ms"]) / (lt["p50_ms"] - chat["p50_ms"])
        rows.append([r["concurrency"], _f(cpu), _f(added), _f(s["turns_per_s"] / lt["turns_per_s"])])
    if rows:
        print("\nSplice against LiteLLM in this run (x = Splice / LiteLLM):")
        print(_table(["C", "proxy CPU per turn x", "added p50 x", "turns/s x"], rows))
