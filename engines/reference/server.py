"""The CPU reference engine: app factory and command line.

One process serves both wire dialects Splice speaks (SGLang ``/generate`` and vLLM
``/v1/completions``) from one model, so integration tests and the demo run the same code paths
as against a GPU server, with real forward passes and real logprobs.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from pathlib import Path

from fastapi import FastAPI

from . import sglang_api, vllm_api, vllm_generate_api, weight_api
from .generator import Worker
from .models import load_language_model
from .model_init import IM_END_ID
from .prefix_cache import DEFAULT_MAX_MB, PrefixCache
from .script import Script, load_script
from .state import EngineState
from .weight_sync import DEFAULT_TIMEOUT_S, WeightGroups

log = logging.getLogger(__name__)


def create_app(
    model_dir: str | os.PathLike,
    *,
    script: str | os.PathLike | list[str] | None = None,
    script_delay_s: float = 0.0,
    weight_version: str = "0",
    served_model_name: str | None = None,
    token_delay_s: float = 0.0,
    seed: int = 0,
    weight_sync_timeout_s: float = DEFAULT_TIMEOUT_S,
    prefix_cache_mb: float = DEFAULT_MAX_MB,
) -> FastAPI:
    """Load the model and return the ASGI app; the worker thread runs for the app's lifespan.

    ``script``: a script file path or a list of assistant texts (script mode). Tokens are
    emitted at most every ``script_delay_s`` seconds in script mode, ``token_delay_s`` otherwise
    (0: as fast as the CPU goes). ``seed`` seeds requests that carry no sampling seed.
    ``weight_sync_timeout_s`` bounds joining a weight-update group and each broadcast.
    ``prefix_cache_mb``: KV of recent sequences kept for prefix reuse (0: off; text models only).
    """
    lm = load_language_model(model_dir)
    scripted = None
    if script is not None:
        texts = load_script(script) if isinstance(script, (str, os.PathLike)) else list(script)
        end_id = IM_END_ID if IM_END_ID in lm.eos_ids else min(lm.eos_ids)
        scripted = Script.from_texts(texts, lm.tokenizer, end_ids=lm.eos_ids, end_id=end_id)
    delay = script_delay_s if scripted is not None else token_delay_s
    prefix = PrefixCache(int(prefix_cache_mb * 1024 * 1024))
    worker = Worker(lm, script=scripted, token_delay_s=delay, weight_version=str(weight_version), seed=seed, prefix_cache=prefix)
    state = EngineState(lm, worker, served_model_name=served_model_name or str(model_dir), script_mode=scripted is not None)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        try:
            yield
        finally:
            worker.stop()

    app = FastAPI(title="Splice reference engine", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine = state
    app.include_router(sglang_api.make_router(state))
    app.include_router(vllm_api.make_router(state))
    app.include_router(vllm_generate_api.make_router(state))
    state.weight_groups = WeightGroups(lm.device, timeout_s=weight_sync_timeout_s)
    app.include_router(weight_api.make_router(state, state.weight_groups))
    return app


def main(argv: list[str] | None = None) -> int:
    """``python -m engines.reference --model DIR [--host] [--port] [--script FILE] ...``."""
    p = argparse.ArgumentParser(prog="splice engine", description="CPU reference engine (SGLang /generate + vLLM /v1/completions)")
    p.add_argument("--model", help="model dir (default: the bundled tiny Qwen3 model, created on first use)")
    p.add_argument("--vision", action="store_true",
                   help="without --model: serve the bundled tiny Qwen2.5-VL-architecture model (created on first use)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--script", help="JSON list of assistant texts to emit instead of sampling")
    p.add_argument("--script-delay-ms", type=float, default=0.0, help="pace of scripted tokens")
    p.add_argument("--token-delay-ms", type=float, default=0.0, help="pace of sampled tokens (0: full speed)")
    p.add_argument("--weight-version", default="0")
    p.add_argument("--served-model-name")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weight-sync-timeout-s", type=float, default=DEFAULT_TIMEOUT_S,
                   help="how long joining a weight-update group, or one broadcast in it, may take")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--prefix-cache-mb", type=float, default=DEFAULT_MAX_MB,
                   help="KV of recent sequences kept so a prompt extending one prefills only its new tokens (0: off)")
    p.add_argument("--log-level", default="warning")
    a = p.parse_args(argv)

    import torch
    import uvicorn

    torch.set_num_threads(max(1, a.threads))
    logging.basicConfig(level=a.log_level.upper())
    model = a.model
    if model is None and a.vision:
        from .vision_files import ensure_vision_model

        model = str(ensure_vision_model())
    elif model is None:
        from .model_init import ensure_model

        model = str(ensure_model())
    if not Path(model, "config.json").is_file():
        p.error(f"--model {model}: no config.json there (create one with: python -m engines.reference init-model DIR)")
    app = create_app(
        model,
        script=a.script,
        script_delay_s=a.script_delay_ms / 1000.0,
        token_delay_s=a.token_delay_ms / 1000.0,
        weight_version=a.weight_version,
        served_model_name=a.served_model_name,
        seed=a.seed,
        weight_sync_timeout_s=a.weight_sync_timeout_s,
        prefix_cache_mb=a.prefix_cache_mb,
    )
    uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level, timeout_graceful_shutdown=5)
    return 0
