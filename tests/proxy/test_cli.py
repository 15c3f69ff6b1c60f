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
