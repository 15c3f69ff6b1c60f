"""Errors and auth over HTTP (docs/design.md 7, 8): OpenAI-shaped error bodies with the right status.

One proxy with ``--api-key``, ``--admin-token`` and a tiny ``--max-context`` serves every test
here; the scripted answer is longer than the context, so clamping ``max_output_tokens`` shows.
"""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from tests.e2e.conftest import ROOT, free_port, kill_tree, start_proxy

pytestmark = pytest.mark.slow

API_KEY = "sk-test-agent-key"
ADMIN = "admin-test-token"
MAX_CONTEXT = 64
ENTRY = " ".join(f"word{i}" for i in range(80)) + "<|im_end|>"  # well over MAX_CONTEXT tokens

AGENT = {"Authorization": f"Bearer {API_KEY}"}
ADMIN_H = {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture(scope="module")
def proxy(tmp_path_factory, model_dir):
    p = start_proxy(
        tmp_path_factory.mktemp("errors"),
        model_dir,
        script=[ENTRY],
        extra=["--api-key", API_KEY, "--admin-token", ADMIN, "--max-context", str(MAX_CONTEXT)],
    )
    yield p
    kill_tree(p)


def _err(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert {"message", "type", "code"} <= set(err), err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if code is not None:
        assert err["code"] == code, err
    return err


def _post(proxy, path: str, body=None, headers=None, content: bytes | None = None) -> httpx.Response:
    if content is not None:
        return httpx.post(proxy.url + path, content=content, headers={"Content-Type": "application/json", **(headers or {})}, timeout=60)
    return httpx.post(proxy.url + path, json=body if body is not None else {}, headers=headers or {}, timeout=60)


def test_api_key_guards_agent_routes(proxy):
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    resp = {"model": "m", "input": "hi", "max_output_tokens": 3}
    for path, body in (("/v1/chat/completions", chat), ("/v1/responses", resp)):
        _err(_post(proxy, path, body), 401)
        _err(_post(proxy, path, body, {"Authorization": "Bearer wrong"}), 401)
        _err(_post(proxy, path, body, {"Authorization": API_KEY}), 401)  # no "Bearer"
        _err(_post(proxy, path, body, ADMIN_H), 401)  # the admin token is not an API key
        assert _post(proxy, path, body, AGENT).status_code == 200
    _err(httpx.get(proxy.url + "/v1/models", timeout=30), 401)
    assert httpx.get(proxy.url + "/v1/models", headers=AGENT, timeout=30).status_code == 200
    err = _err(httpx.get(proxy.url + "/v1/responses/resp_x", timeout=30), 401)
    assert err["type"] == "authentication_error"
    # /health and /metrics stay open
    assert httpx.get(proxy.url + "/health", timeout=30).status_code == 200
    assert httpx.get(proxy.url + "/metrics", timeout=30).status_code == 200


def test_openai_sdk_sees_auth_and_not_found(proxy):
    import openai

    bad = openai.OpenAI(base_url=proxy.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.responses.create(model="m", input="hi")
    good = openai.OpenAI(base_url=proxy.url + "/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        good.responses.retrieve("resp_does_not_exist")
    with pytest.raises(openai.BadRequestError) as exc:
        good.responses.create(model="m", input="many words " * 60)
    assert exc.value.code == "context_length_exceeded"


def test_admin_token_guards_trainer_routes(proxy):
    for path, body in (
        ("/v1/trajectories/pull", {"max_samples": 1}),
        ("/v1/trajectories/ack", {"lease_id": "lease_x"}),
        ("/admin/pause", {}),
        ("/admin/resume", {}),
        ("/admin/version", {"version": 3}),
        ("/admin/update_weights", {"model_path": "/nonexistent", "version": 1}),
    ):
        _err(_post(proxy, path, body), 401)
        _err(_post(proxy, path, body, AGENT), 401)  # the API key is not the admin token
    _err(httpx.get(proxy.url + "/admin/status", timeout=30), 401)
    assert httpx.get(proxy.url + "/admin/status", headers=ADMIN_H, timeout=30).json()["version"] == 0
    r = _post(proxy, "/v1/trajectories/pull", {"max_samples": 1}, ADMIN_H)
    assert r.status_code == 200 and r.json()["samples"] == []
    _err(_post(proxy, "/v1/trajectories/ack", {"lease_id": "lease_x"}, ADMIN_H), 404)
    _err(_post(proxy, "/admin/update_weights", {"model_path": "/nonexistent", "version": 1}, ADMIN_H), 400)
    assert httpx.get(proxy.url + "/health", timeout=30).json()["version"] == 0


def test_the_agent_key_opens_no_trainer_route(proxy):
    """An agent with shell tools holds the API key: it must not list sessions, read them, reward
    itself or pull; the admin token does all of these."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert _post(proxy, "/v1/chat/completions", body, {**AGENT, "X-Session-Id": "self-reward"}).status_code == 200
    for method, path, payload in (
        ("GET", "/v1/sessions", None),
        ("GET", "/v1/sessions/self-reward", None),
        ("POST", "/v1/sessions/self-reward/reward", {"reward": 1.0}),
        ("POST", "/v1/trajectories/pull", {"max_samples": 1}),
    ):
        for h in ({}, AGENT, {"x-api-key": API_KEY}):
            r = httpx.request(method, proxy.url + path, json=payload, headers=h, timeout=30)
            err = _err(r, 401)
            assert "API key is not accepted" in err["message"] or "admin token" in err["message"]
    assert httpx.get(proxy.url + "/v1/sessions/self-reward", headers=ADMIN_H, timeout=30).json()["reward"] is None
    assert httpx.get(proxy.url + "/v1/sessions", headers=ADMIN_H, timeout=30).status_code == 200
    r = _post(proxy, "/v1/sessions/self-reward/reward", {"reward": 1e200}, ADMIN_H)  # finite but unbounded
    _err(r, 400)
    assert _post(proxy, "/v1/sessions/self-reward/reward", {"reward": 0.5}, ADMIN_H).json()["reward"] == 0.5


def test_a_reward_token_rewards_and_reads_but_pulls_nothing(tmp_path, model_dir):
    p = start_proxy(tmp_path, model_dir, script=["ok<|im_end|>"], extra=["--api-key", API_KEY, "--reward-token", "grader"])
    try:
        grader = {"Authorization": "Bearer grader"}
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert _post(p, "/v1/chat/completions", body, {**AGENT, "X-Session-Id": "g"}).status_code == 200
        _err(_post(p, "/v1/chat/completions", body, grader), 401)  # not an agent key
        _err(_post(p, "/v1/sessions/g/reward", {"reward": 1.0}, AGENT), 401)
        _err(httpx.get(p.url + "/v1/sessions/g", headers=AGENT, timeout=30), 401)
        assert httpx.get(p.url + "/v1/sessions/g", headers=grader, timeout=30).status_code == 200
        assert _post(p, "/v1/sessions/g/reward", {"reward": 1.0}, grader).json()["reward"] == 1.0
    finally:
        kill_tree(p)


def test_bad_json_is_400_in_openai_shape(proxy):
    for path, hdr in (
        ("/v1/responses", AGENT),
        ("/v1/chat/completions", AGENT),
        ("/v1/sessions/anything/reward", ADMIN_H),
        ("/v1/trajectories/pull", ADMIN_H),
        ("/admin/update_weights", ADMIN_H),
    ):
        err = _err(_post(proxy, path, headers=hdr, content=b'{"model": "m", "input": '), 400)
        assert err["type"] == "invalid_request_error"
    # valid JSON, wrong shapes: 400, never 500
    for path, body in (
        ("/v1/responses", []),
        ("/v1/responses", {"model": "m", "input": 5}),
        ("/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": -1}),
        ("/v1/chat/completions", {"model": "m", "messages": "hi"}),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "wizard", "content": "hi"}]}),
        ("/v1/chat/completions", {"model": "m", "messages": []}),
    ):
        _err(_post(proxy, path, body, AGENT), 400)
    _err(_post(proxy, "/v1/sessions/anything/reward", {"reward": "lots"}, ADMIN_H), 400)
    _err(_post(proxy, "/v1/trajectories/pull", {"max_samples": 0}, ADMIN_H), 400)
    assert httpx.get(proxy.url + "/health", timeout=30).status_code == 200


def test_context_length_exceeded_and_clamping(proxy):
    long_input = "many words " * 60
    err = _err(_post(proxy, "/v1/responses", {"model": "m", "input": long_input}, AGENT), 400, "context_length_exceeded")
    assert err["type"] == "invalid_request_error"
    _err(_post(proxy, "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": long_input}]}, AGENT), 400, "context_length_exceeded")
    # stream=True fails the same way, before any event is sent
    _err(_post(proxy, "/v1/responses", {"model": "m", "input": long_input, "stream": True}, AGENT), 400, "context_length_exceeded")

    r = _post(proxy, "/v1/responses", {"model": "m", "input": "hi", "max_output_tokens": 4096}, AGENT)
    assert r.status_code == 200, r.text
    body = r.json()
    u = body["usage"]
    # clamped to what fits, less the one position the recompute prefill of the full turn needs
    assert u["input_tokens"] + u["output_tokens"] == MAX_CONTEXT - 1
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    c = _post(proxy, "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10_000}, AGENT)
    assert c.status_code == 200, c.text
    cu = c.json()["usage"]
    assert cu["prompt_tokens"] + cu["completion_tokens"] == MAX_CONTEXT - 1
    assert c.json()["choices"][0]["finish_reason"] == "length"


def test_unknown_ids_are_404(proxy):
    _err(httpx.get(proxy.url + "/v1/responses/resp_0123456789abcdef01234567", headers=AGENT, timeout=30), 404)
    _err(_post(proxy, "/v1/responses", {"model": "m", "input": "hi", "previous_response_id": "resp_nope"}, AGENT), 404)
    _err(httpx.get(proxy.url + "/v1/sessions/nope", headers=ADMIN_H, timeout=30), 404)
    _err(_post(proxy, "/v1/sessions/nope/reward", {"reward": 1.0}, ADMIN_H), 404)


def test_session_group_cannot_change(proxy):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    sid = "grp-change"
    r1 = _post(proxy, "/v1/chat/completions", body, {**AGENT, "X-Session-Id": sid, "X-Group-Id": "g1", "X-Group-Size": "2"})
    assert r1.status_code == 200, r1.text
    _err(_post(proxy, "/v1/chat/completions", body, {**AGENT, "X-Session-Id": sid, "X-Group-Id": "g2", "X-Group-Size": "2"}), 409)
    _err(_post(proxy, "/v1/chat/completions", body, {**AGENT, "X-Session-Id": sid, "X-Group-Id": "g1", "X-Group-Size": "3"}), 409)
    _err(_post(proxy, "/v1/chat/completions", body, {**AGENT, "X-Session-Id": sid, "X-Group-Size": "zero"}), 400)
    s = httpx.get(f"{proxy.url}/v1/sessions/{sid}", headers=ADMIN_H, timeout=30).json()
    assert s["group_id"] == "g1" and s["group_size"] == 2 and len(s["turns"]) == 1


def test_public_bind_never_opens_the_trainer_routes(tmp_path):
    """Without --admin-token a public bind uses the generated token like any other (the routes
    are never open); a token file other users could read is refused before anything starts."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "admin_token").write_text("readable\n")
    os.chmod(home / "admin_token", 0o644)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPLICE_")}
    env.update(PYTHONPATH=str(ROOT), SPLICE_HOME=str(home))
    for host_args, extra_env in ((["--host", "0.0.0.0"], {}), ([], {"SPLICE_HOST": "0.0.0.0"})):
        r = subprocess.run(
            [sys.executable, "-m", "proxy.cli", "serve", *host_args, "--port", str(free_port()), "--store", str(tmp_path / "s.sqlite")],
            cwd=str(tmp_path), env={**env, **extra_env}, capture_output=True, text=True, timeout=120,
        )
        assert r.returncode == 2
        assert "chmod 600" in r.stderr and "--admin-token" in r.stderr, r.stderr
    assert not (tmp_path / "s.sqlite").exists()  # refused before touching anything
