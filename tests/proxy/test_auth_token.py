"""The generated admin token file and who finds it: created once (0600) and reused, complete or
absent when several ``splice serve`` start at once, refused when others may read it; the trainer
client sends it only to proxies on this machine, ``$SPLICE_ADMIN_TOKEN`` first. And the route
table: with any credential configured, no trainer route is open without the admin token."""

from __future__ import annotations

import multiprocessing
import os
import stat

import pytest

from proxy.auth import TokenFileError, check, load_or_create_admin_token
from proxy.errors import APIError
from trainer_bridge.client import ProxyClient, discover_admin_token


def test_created_once_private_and_reused(tmp_path):
    path = tmp_path / "home" / "admin_token"
    token, created = load_or_create_admin_token(path)
    assert created and len(token) >= 40
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_or_create_admin_token(path) == (token, False)
    assert [p.name for p in path.parent.iterdir()] == ["admin_token"]  # no temporary file left


def _create(path: str, q) -> None:
    from pathlib import Path

    q.put(load_or_create_admin_token(Path(path)))


def test_concurrent_serves_agree_on_one_token(tmp_path):
    path = str(tmp_path / "admin_token")
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_create, args=(path, q)) for _ in range(6)]
    for p in procs:
        p.start()
    got = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
    assert len({t for t, _ in got}) == 1
    assert sum(created for _, created in got) == 1


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o606])
def test_a_file_others_may_read_is_refused(tmp_path, mode):
    path = tmp_path / "admin_token"
    path.write_text("t0k3n\n")
    os.chmod(path, mode)
    with pytest.raises(TokenFileError, match="chmod 600"):
        load_or_create_admin_token(path)
    assert path.read_text() == "t0k3n\n"  # left as it was


def test_an_empty_file_is_refused(tmp_path):
    path = tmp_path / "admin_token"
    path.touch(mode=0o600)
    with pytest.raises(TokenFileError, match="empty"):
        load_or_create_admin_token(path)


def test_the_client_sends_the_local_token_only_to_local_proxies(tmp_path, monkeypatch):
    monkeypatch.delenv("SPLICE_ADMIN_TOKEN", raising=False)
    monkeypatch.setenv("SPLICE_HOME", str(tmp_path))
    assert discover_admin_token(["http://127.0.0.1:8000"]) is None  # no proxy generated one yet
    token, _ = load_or_create_admin_token(tmp_path / "admin_token")
    for local in (["http://127.0.0.1:8000"], ["http://localhost:1"], ["http://[::1]:8000", "http://127.0.0.2:9"]):
        assert discover_admin_token(local) == token
    for remote in (["http://10.0.0.5:8000"], ["http://127.0.0.1:8000", "http://trainer.example:8000"]):
        assert discover_admin_token(remote) is None
    with ProxyClient("http://127.0.0.1:8000") as c:
        assert c._http.headers["authorization"] == f"Bearer {token}"
    with ProxyClient("http://proxy.example:8000") as c:
        assert "authorization" not in c._http.headers
    monkeypatch.setenv("SPLICE_ADMIN_TOKEN", "from-env")
    assert discover_admin_token(["http://proxy.example:8000"]) == "from-env"
    os.chmod(tmp_path / "admin_token", 0o644)
    monkeypatch.delenv("SPLICE_ADMIN_TOKEN")
    assert discover_admin_token(["http://127.0.0.1:8000"]) is None  # not a private file: not trusted


TRAINER_PATHS = ["/v1/trajectories/pull", "/v1/trajectories/samples", "/v1/trajectories/ack", "/v1/images/" + "a" * 64,
                 "/admin/pause", "/admin/version", "/admin/weights/commit", "/admin"]  # fmt: skip
SESSION_PATHS = ["/v1/sessions", "/v1/sessions/s", "/v1/sessions/s/reward"]


@pytest.mark.parametrize("path", TRAINER_PATHS + SESSION_PATHS)
def test_with_only_an_agent_key_no_trainer_route_opens(path):
    for offered in (None, "Bearer agent", "Bearer "):
        with pytest.raises(APIError) as ei:
            check(path, offered, api_key="agent", admin_token=None, x_api_key="agent")
        assert ei.value.status == 401


@pytest.mark.parametrize("path", TRAINER_PATHS + SESSION_PATHS)
def test_the_agent_key_never_opens_a_trainer_route(path):
    for offered in (None, "Bearer agent"):
        with pytest.raises(APIError):
            check(path, offered, api_key="agent", admin_token="admin", x_api_key="agent")
    check(path, "Bearer admin", api_key="agent", admin_token="admin")


def test_metrics_beyond_loopback_take_the_admin_token():
    check("/metrics", None, api_key=None, admin_token="admin")  # loopback: open
    with pytest.raises(APIError):
        check("/metrics", None, api_key=None, admin_token="admin", metrics_open=False)
    with pytest.raises(APIError):
        check("/metrics", "Bearer agent", api_key="agent", admin_token="admin", metrics_open=False)
    check("/metrics", "Bearer admin", api_key=None, admin_token="admin", metrics_open=False)


def test_a_proxy_beyond_loopback_guards_metrics(tmp_path):
    """The app's own middleware: /metrics takes the admin token once the listen host is not
    loopback; /health stays open."""
    import asyncio

    import httpx

    from proxy.app import create_app
    from proxy.settings import Settings
    from tests.fakes.engines import FixedPool
    from tokenization import ChatFormat, load_tokenizer, qwen3_tokenizer_dir

    fmt = ChatFormat(load_tokenizer(str(qwen3_tokenizer_dir())), "qwen3")

    async def status(host: str, headers: dict) -> tuple[int, int]:
        app = create_app(Settings(store=str(tmp_path / f"{host}.sqlite"), host=host, admin_token="adm"), fmt=fmt, pool=FixedPool([1]))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return (await c.get("/metrics", headers=headers)).status_code, (await c.get("/health")).status_code

    assert asyncio.run(status("127.0.0.1", {})) == (200, 200)
    assert asyncio.run(status("0.0.0.0", {})) == (401, 200)
    assert asyncio.run(status("0.0.0.0", {"Authorization": "Bearer adm"})) == (200, 200)
