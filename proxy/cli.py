"""The ``splice`` command: serve, engine, init-model, demo, train, bench."""

from __future__ import annotations

import argparse
import hmac
import logging
import os
import sys

from .settings import Settings


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="run the proxy")
    p.add_argument("--engine", choices=["sglang", "vllm", "reference"])
    p.add_argument("--engine-url", action="append", dest="engine_url", metavar="URL", help="repeatable; replicas")
    p.add_argument("--routing", choices=["hash", "least-loaded"], help="sessions -> replicas: consistent hashing (default), or least in-flight at first placement, then sticky")
    p.add_argument("--tokenizer", metavar="PATH_OR_ID")
    p.add_argument("--renderer", metavar="NAME", help="a renderers family (e.g. qwen3) or 'generic'")
    p.add_argument("--model-name")
    p.add_argument("--engine-model", help="model id sent to vLLM (default: the one its /v1/models lists)")
    p.add_argument("--store", metavar="PATH")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--admin-token", help="the trainer's credential: pulls, /admin, session listing / reading / rewards "
                                          "(default: generated once into $SPLICE_HOME/admin_token, mode 0600, where "
                                          "splice train / publish / export on this machine find it)")
    p.add_argument("--api-key", help="the agents' credential (Responses, Chat, Messages); never opens a trainer route")
    p.add_argument("--reward-token", help="a grader's credential: rewards and session listing / reading only")
    p.add_argument("--no-ui", dest="ui", action="store_false", default=None,
                   help="do not serve the session viewer at /ui (docs/viewer.md)")
    p.add_argument("--thinking-retention", choices=["all", "tool_cycle", "template"])
    p.add_argument("--history-edits", choices=["fork", "keep"],
                   help="a replayed history edited only in system/developer text or earlier tool arguments: fork (default) "
                        "or keep (continue the recorded tokens; the edit is recorded). Per request: X-Splice-History-Edits")
    p.add_argument("--train-auxiliary", action="store_true", default=None,
                   help="hand harness side calls (titles, topics, quota probes: role auxiliary) to the trainer as samples of their own")
    p.add_argument("--sampling", choices=["trainable", "honor"])
    p.add_argument("--drift-check", choices=["all", "sampled", "off"])
    p.add_argument("--temperature", type=float)
    p.add_argument("--max-context", type=int)
    p.add_argument("--max-output-tokens", type=int, help="cap on every turn's output (default: what fits in the context)")
    p.add_argument("--lease-timeout-s", type=float)
    p.add_argument("--recompute-deadline-s", type=float, help="longest a pause or pull waits for owed proximal values (R2) before going ahead without them (default 60)")
    p.add_argument("--recompute-concurrency", type=int, help="R2 prefill-only calls in flight per engine replica (default 2)")
    p.add_argument("--max-staleness", type=int, metavar="K", help="a pull drops samples holding loss tokens older than current version - K (default: off)")
    p.add_argument("--max-pause-s", type=float, help="a pause nobody resumes is lifted after this many seconds (default 600): held agent turns never wait longer")
    p.add_argument("--transfer-deadline-s", type=float,
                   help="an engine out of rotation for a weight transfer with no join, bucket or commit for this long is abandoned: "
                        "reloaded from disk when the current weights are on disk, else kept out with that status (default 600)")
    p.add_argument("--engine-timeout-s", type=float, help="total deadline of one engine call, in seconds (default 600)")
    p.add_argument("--max-inflight", type=int, help="turns in flight before new ones wait (default: 128 per CPU core, 256-4096)")
    p.add_argument("--admission-wait-s", type=float, help="how long a turn beyond --max-inflight waits before 429 (default 2)")
    p.add_argument("--max-request-bytes", type=int, help="largest request body accepted (default 32 MiB)")
    p.add_argument("--max-header-bytes", type=int, help="largest request line + headers accepted (default 64 KiB; larger: 431)")
    p.add_argument("--header-timeout-s", type=float, help="time a client has to send its request headers (default 10; then 408)")
    p.add_argument("--body-timeout-s", type=float, help="time a client has to send its whole request body after the headers "
                                                        "(default 60; then 408); a turn takes an admission slot only once its body is read")
    p.add_argument("--keepalive-s", type=float, help="how long an agent's idle connection is kept open (default 120: "
                                                     "longer than common clients' pool idle time, so they close first)")
    p.add_argument("--allow-image-urls", action="store_true", default=None,
                   help="fetch http(s) image URLs in requests (default: only inline base64 images; a URL is a 400)")
    p.add_argument("--max-image-bytes", type=int, help="largest encoded image accepted, inline or fetched (default 20 MiB)")
    p.add_argument("--max-image-pixels", type=int, help="largest decoded image, width x height (default 50,000,000)")
    p.add_argument("--max-images-per-request", type=int, help="image parts one request may carry, history included (default 64)")
    p.add_argument("--image-fetch-timeout-s", type=float, help="time limit to fetch one image URL (default 10)")
    p.add_argument("--quiet", action="store_true", default=None, help="no line per finished turn, no progress lines")
    p.add_argument("--image-url-allow-net", action="append", metavar="CIDR",
                   help="repeatable: a network image URLs may be fetched from although it is not public (default: public "
                        "addresses only; loopback, private, link-local and multicast ones are refused)")
    p.add_argument("--max-request-image-pixels", type=int, help="pixels of one request's images together (default 256,000,000)")
    p.add_argument("--image-decode-concurrency", type=int, help="image decodes at once in the whole proxy (default 2)")
    p.add_argument("--reference-model", metavar="DIR", help="model dir for the bundled engine (created if missing)")
    p.add_argument("--reference-script", metavar="FILE",
                   help="JSON list of replies the bundled engine emits instead of sampling; 'first-try': a short reply "
                        "(the default for the bundled untrained model); 'none': sample")
    p.add_argument("--reference-script-delay-ms", type=int)


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Flags override ``SPLICE_*`` environment variables, which override defaults."""
    overrides = {k: v for k, v in vars(args).items() if v is not None and k in Settings.model_fields}
    return Settings(**overrides)


def resolve_admin_token(settings: Settings) -> tuple[Settings, str]:
    """Settings with an admin token, and where it came from: the one given (flag or
    ``SPLICE_ADMIN_TOKEN``), else the one in ``$SPLICE_HOME/admin_token``, generated if missing.
    Raises ``SystemExit`` (one line) when the token file cannot be used or tokens collide."""
    from .auth import TokenFileError, admin_token_file, load_or_create_admin_token

    source = "as given"
    if not settings.admin_token:
        path = admin_token_file()
        try:
            token, created = load_or_create_admin_token(path)
        except (TokenFileError, OSError) as exc:
            raise SystemExit(f"splice serve: {exc} (or pass --admin-token)") from None
        settings = settings.model_copy(update={"admin_token": token})
        source = f"{'generated into' if created else 'read from'} {path}"
    tokens = {"--api-key": settings.api_key, "--reward-token": settings.reward_token}
    for flag, value in tokens.items():
        if value is not None and hmac.compare_digest(value.encode(), settings.admin_token.encode()):
            raise SystemExit(f"splice serve: {flag} equals the admin token; the trainer's credential must be its own")
    if settings.api_key is not None and settings.api_key == settings.reward_token:
        raise SystemExit("splice serve: --api-key equals --reward-token; an agent could then grade itself")
    return settings, source


def build(settings: Settings):
    """Engine pool, chat format and (for the embedded default) a function that stops the engine process."""
    engine_proc = None
    urls = list(settings.engine_url)
    tokenizer_path = settings.tokenizer
    renderer = settings.renderer
    if not urls:
        from engines.reference.model_init import ensure_model

        from engines.reference.launch import start_engine

        # absolute: the engine child runs from the repository root, not from the user's directory
        model_dir = os.path.abspath(ensure_model(settings.reference_model))
        settings, script = _bundled_defaults(settings)
        url, engine_proc = start_engine(
            model_dir, script=script, script_delay_s=settings.reference_script_delay_ms / 1000.0,
            timeout_s=120.0, capture_log=False, die_with_parent=True,
        )
        urls = [url]
        tokenizer_path = tokenizer_path or model_dir
        renderer = renderer or "qwen3"  # the bundled model is Qwen3 with the real Qwen3 template
    try:
        settings, fmt, pool = _build_proxy(settings, urls, tokenizer_path, renderer)
    except BaseException:
        if engine_proc is not None:
            engine_proc()
        raise
    return settings, fmt, pool, engine_proc


def _bundled_defaults(settings: Settings) -> tuple[Settings, "str | list[str] | None"]:
    """The engine script (a file, a list of replies, or None to sample) and, for the bundled
    untrained model, first-try defaults: it never samples an end of turn, so it answers with a
    short scripted reply unless ``--reference-script none``, and sampled turns get a small output
    budget instead of the whole context. A model of your own keeps both as given."""
    from engines.reference.first_try import FIRST_TRY_SCRIPT, SAMPLED_MAX_OUTPUT_TOKENS

    chosen = settings.reference_script
    if chosen is not None and chosen.lower() == "none":
        chosen = ""
    if chosen == "first-try":  # by name, for any model
        return settings, list(FIRST_TRY_SCRIPT)
    if chosen:  # absolute: the engine child runs from the repository root, not from the user's directory
        return settings, os.path.abspath(chosen)
    if settings.reference_model is not None:
        return settings, None
    if chosen is None:
        return settings.model_copy(update={"reference_script": "first-try"}), list(FIRST_TRY_SCRIPT)
    if settings.max_output_tokens is None:
        settings = settings.model_copy(update={"max_output_tokens": SAMPLED_MAX_OUTPUT_TOKENS})
    return settings.model_copy(update={"reference_script": None}), None


def _build_proxy(settings: Settings, urls: list[str], tokenizer_path: str | None, renderer: str | None):
    from engines.pool import EnginePool
    from tokenization import ChatFormat, load_tokenizer, renderer_name_for
    from tokenization.vision import VisionSpec

    kind = "vllm" if settings.engine == "vllm" else "sglang"
    if not tokenizer_path:
        tokenizer_path = _engine_model_path(kind, urls, settings)
    try:
        tok = load_tokenizer(tokenizer_path)
    except Exception as exc:  # noqa: BLE001 - any loader failure gets the same advice
        raise SystemExit(
            f"cannot load the tokenizer from {tokenizer_path!r} (the engine's model): {exc}. "
            "Pass --tokenizer PATH_OR_ID with the tokenizer of the model the engine serves."
        ) from None
    name = renderer_name_for(settings.model_name, renderer) if renderer != "generic" else None
    # A vision model's folder has the image processor's config: images are then accepted.
    vision = VisionSpec.from_model_dir(tokenizer_path, tok) if os.path.isdir(tokenizer_path) else None
    fmt = ChatFormat(tok, name, thinking_retention=settings.thinking_retention, vision=vision)
    pool = EnginePool(
        kind, urls, model=settings.engine_model or "", timeout_s=settings.engine_timeout_s, routing=settings.routing,
        prefill_concurrency=settings.recompute_concurrency, transfer_deadline_s=settings.transfer_deadline_s,
    )  # fmt: skip
    return settings, fmt, pool


def _engine_model_path(kind: str, urls: list[str], settings: Settings) -> str:
    """Where the engine says its model lives (the default tokenizer); a clear error otherwise."""
    import asyncio

    from engines.pool import EnginePool

    async def ask() -> str | None:
        pool = EnginePool(kind, urls, model=settings.engine_model or "", timeout_s=30.0, health_interval_s=0)
        try:
            await pool.start()
            return pool.info.model_path
        finally:
            await pool.close()

    try:
        path = asyncio.run(ask())
    except Exception as exc:  # noqa: BLE001
        raise SystemExit(f"cannot ask the engine at {urls[0]} for its model ({exc}); pass --tokenizer PATH_OR_ID") from None
    if not path:
        raise SystemExit("the engine did not say which model it serves; pass --tokenizer PATH_OR_ID")
    return path


def serve(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    if settings.temperature != 1.0 and settings.sampling == "trainable":
        print(
            f"refusing --temperature {settings.temperature}: SGLang scales output logprobs by temperature but not "
            "prompt logprobs (used for proximal values), and vLLM returns raw logprobs, so behaviour and proximal "
            "logprobs would come from different distributions. Sample at 1.0, or use --sampling honor (turns are "
            "then marked not trainable).",
            file=sys.stderr,
        )
        return 2
    try:
        settings, token_source = resolve_admin_token(settings)
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return 2
    os.makedirs(os.path.dirname(os.path.abspath(settings.store)), exist_ok=True)
    _exit_on_sigterm()
    try:
        return _serve(settings, token_source)
    except KeyboardInterrupt:  # SIGINT / Ctrl-C: everything started has been stopped on the way out
        return 130
    except _Terminated as exc:
        return 128 + exc.signum


class _Terminated(BaseException):
    """SIGTERM (Docker, Kubernetes, systemd) or SIGHUP (the terminal went away): unwinds like
    Ctrl-C, so every ``finally`` runs; the exit status is 128 + the signal's number."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _exit_on_sigterm() -> None:
    import signal

    def handler(signum, frame):
        raise _Terminated(signum)

    signal.signal(signal.SIGTERM, handler)
    if hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, handler)


def _serve(settings: Settings, token_source: str = "as given") -> int:
    """Build, serve, and stop what was started. A SIGTERM or SIGINT while the engine starts, while
    serving (uvicorn shuts down gracefully, then re-raises the signal) or while shutting down
    unwinds through the ``finally`` blocks; the engine child also dies with this process if it is
    killed outright (``die_with_parent``)."""
    import contextlib
    import signal
    import threading

    import uvicorn

    from .app import create_app
    from .http_server import server_options

    from .turn_log import configure as turn_lines

    settings, fmt, pool, engine_proc = build(settings)
    app = create_app(settings, fmt=fmt, pool=pool)
    turn_lines(enabled=not settings.quiet)
    base = f"http://{settings.host}:{settings.port}"
    from engines.http import redact_url

    engines = ", ".join(redact_url(u) for u in (settings.engine_url or [_bundled_engine_words(settings)]))

    class Server(uvicorn.Server):
        received: int | None = None  # the first shutdown signal

        def handle_exit(self, sig: int, frame) -> None:
            self.received = self.received or sig
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            """uvicorn shuts down gracefully on SIGINT / SIGTERM and re-raises them after; SIGHUP
            the same way (without this it would land in whichever request task was running)."""
            with super().capture_signals():
                if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGHUP"):
                    yield
                    return
                previous = signal.signal(signal.SIGHUP, self.handle_exit)
                try:
                    yield
                finally:
                    signal.signal(signal.SIGHUP, previous)

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started:  # bound and serving: say so once, with what a user needs next
                print(
                    f"splice ready: agents {base}/v1 | admin {base}/admin | engine {settings.engine} at {engines} "
                    f"| version {pool.version} | store {settings.store} | admin token {token_source}",
                    flush=True,
                )

    try:
        limits = server_options(settings.max_header_bytes, settings.header_timeout_s, settings.keepalive_s)
        server = Server(uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning", access_log=False, **limits))
        server.run()
    finally:
        if engine_proc is not None:
            engine_proc()
    # uvicorn re-raises the signal once shut down; a SIGINT the parent set to ignore (`splice serve &`
    # from a script) then does nothing, so the status still says which signal stopped the server
    return 128 + server.received if server.received else 0


def _bundled_engine_words(settings: Settings) -> str:
    if settings.reference_model is not None:
        return f"the bundled reference engine ({settings.reference_model})"
    if settings.reference_script == "first-try":
        return ("the bundled reference engine (tiny untrained model: every reply is a short scripted one; "
                "--reference-script none samples it, --engine-url uses your SGLang / vLLM server)")  # fmt: skip
    return "the bundled reference engine (tiny untrained model)"


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("SPLICE_LOG_LEVEL", "WARNING"), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    parser = argparse.ArgumentParser(prog="splice", description="token-exact OpenAI-compatible proxy for agentic RL")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    sub.add_parser("engine", help="run the CPU reference engine (SGLang/vLLM subset)", add_help=False)
    sub.add_parser("init-model", help="write the tiny Qwen3-architecture model with the real Qwen3 tokenizer (--vision: a tiny Qwen2.5-VL one)", add_help=False)
    sub.add_parser("demo", help="the whole loop: engine, proxy, agents, trainer", add_help=False)
    sub.add_parser("train", help="the GRPO trainer loop against one or more proxies", add_help=False)
    sub.add_parser("publish", help="publish weights to a fleet of proxies (each engine loads once, from a path or by torch.distributed broadcast)", add_help=False)
    sub.add_parser("bench", help="benchmarks (overhead, paired, splice, store, logprobs, pull, recompute, soak, publish, train, images)", add_help=False)
    sub.add_parser("export", help="training samples to Parquet files (HF datasets)", add_help=False)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("engine", "init-model", "demo", "train", "publish", "bench", "export"):
        cmd, rest = argv[0], argv[1:]
        if cmd == "engine":
            from engines.reference.server import main as engine_main

            return engine_main(rest) or 0
        if cmd == "init-model":
            from engines.reference.model_init import main as init_main

            return init_main(rest) or 0
        if cmd == "train":
            # Lazy, and the one place the proxy package reaches the trainer (it needs torch; a
            # sidecar does not): the trainer talks to the proxy only over HTTP.
            from trainer_bridge.train import main as train_main

            return train_main(rest) or 0
        if cmd == "publish":
            from trainer_bridge.publish import main as publish_main  # HTTP only; no torch needed

            return publish_main(rest) or 0
        if cmd == "demo":
            from .demo import main as demo_main

            return demo_main(rest) or 0
        if cmd == "export":
            from .export import main as export_main

            return export_main(rest) or 0
        if cmd == "bench":
            from .bench import main as bench_main

            return bench_main(rest) or 0
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
