"""Transport and status failures map to the typed errors the pool's failover relies on."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
import respx

from engines.http_transport import EngineTransport
from engines.sglang import SGLangClient
from engines.types import EngineBadResponse, EngineRejected, EngineTimeout, EngineUnavailable, SamplingParams
from engines.vllm import VLLMClient

URL = "http://sglang-a:30000"


def run(coro):
    return asyncio.run(coro)


async def _generate(side_effect, client_cls=SGLangClient, path="/generate", timeout_s=5.0):
    with respx.mock(assert_all_called=False) as router:
        router.post(URL + path).mock(side_effect=side_effect)
        router.post(URL + "/abort_request").mock(return_value=httpx.Response(200))
        async with httpx.AsyncClient(transport=EngineTransport()) as http:
            return await client_cls(http, URL, timeout_s=timeout_s).generate([1, 2], SamplingParams(), rid="r")


@pytest.mark.parametrize(
    "effect, expected",
    [
        (httpx.ConnectError("Connection refused"), EngineUnavailable),
        (httpx.RemoteProtocolError("Server disconnected"), EngineUnavailable),
        (httpx.ReadTimeout("timed out"), EngineTimeout),
        (httpx.Response(503, text="overloaded"), EngineBadResponse),
        (httpx.Response(500, json={"error": "internal"}), EngineBadResponse),
        (httpx.Response(200, content=b"{not json"), EngineBadResponse),
        (httpx.Response(200, json=[1, 2]), EngineBadResponse),
        (httpx.Response(400, json={"error": {"message": "Unknown sampling key: foo"}}), EngineRejected),
    ],
)
@pytest.mark.parametrize("client_cls, path", [(SGLangClient, "/generate"), (VLLMClient, "/v1/completions")])
def test_error_mapping(effect, expected, client_cls, path):
    side_effect = effect if isinstance(effect, Exception) else (lambda request, r=effect: r)
    with pytest.raises(expected) as info:
        run(_generate(side_effect, client_cls, path))
    assert info.value.replica == URL
    assert info.value.retryable is (expected is not EngineRejected)


def test_rejection_keeps_the_engine_message():
    effect = httpx.Response(400, json={"error": {"message": "Unknown sampling key: foo"}})
    with pytest.raises(EngineRejected, match="Unknown sampling key"):
        run(_generate(lambda request: effect))


def test_real_refused_connection_and_real_timeout():
    """Over real loopback sockets: a closed port refuses, a silent listener times out."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    silent_port = listener.getsockname()[1]

    async def go(port, timeout_s):
        async with httpx.AsyncClient(transport=EngineTransport()) as http:
            c = SGLangClient(http, f"http://127.0.0.1:{port}", timeout_s=timeout_s)
            c._abort_quietly = _noop  # the silent listener would not answer an abort either
            return await c.generate([1], SamplingParams(), rid="r")

    async def _noop(rid):
        return None

    try:
        with pytest.raises(EngineUnavailable):
            run(go(closed_port, 5.0))
        with pytest.raises(EngineTimeout):
            run(go(silent_port, 0.3))
    finally:
        listener.close()
