import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "proxy.cli", "serve", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_a_temperature_the_logprobs_cannot_match_is_refused():
    r = _serve("--temperature", "0.7", "--engine-url", "http://127.0.0.1:9")
    assert r.returncode == 2 and "temperature" in r.stderr


def test_settings_come_from_flags_over_environment(monkeypatch):
    from proxy.cli import settings_from_args
    import argparse

    monkeypatch.setenv("SPLICE_PORT", "9123")
    monkeypatch.setenv("SPLICE_ENGINE_URL", '["http://a:1", "http://b:2"]')
    s = settings_from_args(argparse.Namespace(port=None, engine_url=None, model_name="m"))
    assert s.port == 9123 and s.engine_url == ["http://a:1", "http://b:2"] and s.model_name == "m"
    s = settings_from_args(argparse.Namespace(port=8000, engine_url=["http://c:3"]))
    assert s.port == 8000 and s.engine_url == ["http://c:3"]


def test_without_tokenizer_the_engines_model_is_used_or_start_up_names_the_flag(tmp_path):
    """No --tokenizer: the tokenizer is the engine's model; when that cannot be had, start-up
    fails with a message naming --tokenizer (never a silent fallback to another model's)."""
    r = _serve("--engine-url", "http://127.0.0.1:9", "--store", str(tmp_path / "s.sqlite"))
    assert r.returncode != 0 and "--tokenizer" in r.stderr, r.stderr[-2000:]


def test_engine_model_path_becomes_the_tokenizer(tmp_path):
    import time

    import httpx

    from engines.reference.launch import free_port
    from engines.reference.model_init import ensure_model
    from engines.reference.testing import start_engine_in_thread

    model = str(ensure_model(tmp_path / "tiny"))
    url, stop = start_engine_in_thread(model)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "serve", "--engine-url", url, "--port", str(port), "--store", str(tmp_path / "s.sqlite")],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert proc.poll() is None, proc.stdout.read()
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        proc.terminate()
        proc.wait(20)
        stop()
    out = proc.stdout.read()
    assert out.count("splice ready:") == 1 and f"agents http://127.0.0.1:{port}/v1" in out and f"admin http://127.0.0.1:{port}/admin" in out


def test_r2_flags_reach_the_settings_and_bad_values_are_refused():
    import argparse

    import pytest
    from pydantic import ValidationError

    from proxy.cli import main, settings_from_args

    s = settings_from_args(argparse.Namespace(recompute_deadline_s=5.0, recompute_concurrency=4, max_staleness=2))
    assert (s.recompute_deadline_s, s.recompute_concurrency, s.max_staleness) == (5.0, 4, 2)
    d = settings_from_args(argparse.Namespace())
    assert (d.recompute_deadline_s, d.recompute_concurrency, d.max_staleness) == (60.0, 2, None)
    with pytest.raises(ValidationError):
        settings_from_args(argparse.Namespace(recompute_concurrency=0))
    with pytest.raises(SystemExit):
        main(["serve", "--max-staleness", "two"])
