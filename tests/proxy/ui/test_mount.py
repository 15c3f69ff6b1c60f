"""The viewer's mount, its flag and its credential, in one process (no browser): ``--no-ui``
removes every ``/ui`` route; the page shell is open and holds no data; the data endpoints take
exactly the credentials that read sessions (``GET /v1/sessions``), never the agents' key."""

from __future__ import annotations

import argparse

import pytest
from fastapi.testclient import TestClient

from proxy.app import create_app
from proxy.cli import _serve_parser, settings_from_args
from proxy.settings import Settings
from tests.fakes.engines import FixedPool
from tokenization import ChatFormat, load_tokenizer, qwen3_tokenizer_dir

TOK = load_tokenizer(str(qwen3_tokenizer_dir()))
DATA = ["/ui/api/sessions", "/ui/api/choices", "/ui/api/now", "/ui/api/session?id=x", "/ui/api/tokens?id=x", "/ui/api/overview?id=x"]


def _client(tmp_path, **settings) -> TestClient:
    app = create_app(Settings(store=str(tmp_path / "s.sqlite"), **settings), fmt=ChatFormat(TOK, "qwen3"),
                     pool=FixedPool(TOK.encode("ok<|im_end|>", add_special_tokens=False)))  # fmt: skip
    return TestClient(app, raise_server_exceptions=False)


def _parse(argv: list[str]) -> Settings:
    parser = argparse.ArgumentParser()
    _serve_parser(parser.add_subparsers(dest="cmd"))
    return settings_from_args(parser.parse_args(["serve", *argv]))


def test_the_flag_turns_the_viewer_off(monkeypatch):
    monkeypatch.delenv("SPLICE_UI", raising=False)
    assert _parse([]).ui is True
    assert _parse(["--no-ui"]).ui is False
    monkeypatch.setenv("SPLICE_UI", "false")
    assert _parse([]).ui is False


def test_without_the_viewer_no_ui_route_answers(tmp_path):
    with _client(tmp_path, ui=False) as c:
        for path in ["/ui", "/ui/", "/ui/static/app.js", *DATA]:
            assert c.get(path).status_code == 404, path
        assert c.get("/v1/sessions").status_code == 200  # the rest of the proxy is unchanged


@pytest.mark.parametrize("token", ["admin", "reward"])
def test_the_data_takes_the_session_reading_credential_only(tmp_path, token):
    with _client(tmp_path, admin_token="admin", reward_token="reward", api_key="agent") as c:
        shell = c.get("/ui")
        assert shell.status_code == 200 and shell.headers["content-type"].startswith("text/html")
        assert "connect-src 'self'" in shell.headers["content-security-policy"]
        assert c.get("/ui/static/app.js").status_code == 200
        assert c.get("/ui/static/nope.js").status_code == 404
        for path in DATA:
            assert c.get(path).status_code == 401, path
            assert c.get(path, headers={"Authorization": "Bearer agent"}).status_code == 401, path
            # the same answer /v1/sessions gives that credential
            assert c.get("/v1/sessions", headers={"Authorization": f"Bearer {token}"}).status_code == 200
            assert c.get(path, headers={"Authorization": f"Bearer {token}"}).status_code in (200, 404), path
        listed = c.get("/ui/api/sessions", headers={"Authorization": f"Bearer {token}"})
        assert listed.status_code == 200 and listed.json()["data"] == []


def test_bad_parameters_are_clear_errors(tmp_path):
    with _client(tmp_path) as c:
        for path, param in [("/ui/api/sessions?rewarded=maybe", "rewarded"), ("/ui/api/sessions?limit=0", "limit"),
                            ("/ui/api/sessions?version_min=x", "version_min"), ("/ui/api/sessions?cursor=zz", "cursor"),
                            ("/ui/api/sessions?role=title", "role")]:  # fmt: skip
            r = c.get(path)
            assert r.status_code == 400, path
            assert r.json()["error"]["param"] == param
        assert "one of main, auxiliary, subagent, compacted" in c.get("/ui/api/sessions?role=title").json()["error"]["message"]
        assert c.get("/ui/api/sessions?role=Auxiliary").status_code == 200
        assert c.get("/ui/api/choices").json()["roles"] == ["main", "auxiliary", "subagent", "compacted"]
        r = c.get("/ui/api/session?id=none")
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
        assert c.get("/ui/api/images/" + "0" * 64).status_code == 404
        assert c.get("/ui/api/images/xyz").status_code == 400


def test_the_page_ships_as_package_data():
    """A non-editable install carries every file of the page: pyproject's package-data globs
    cover each of them (an asset they miss would 500 in a wheel install only)."""
    import fnmatch
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["proxy"]
    static = root / "proxy" / "ui" / "static"
    files = [p.relative_to(root / "proxy").as_posix() for p in static.rglob("*") if p.is_file()]
    assert {"ui/static/index.html", "ui/static/app.js", "ui/static/app.css"} <= set(files)
    assert [f for f in files if not any(fnmatch.fnmatch(f, g) for g in globs)] == []
