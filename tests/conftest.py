"""Settings every test shares."""

from unittest import mock

import httpx
import respx.mocks
from hypothesis import settings
from respx.mocks import HTTPCoreMocker

from engines.http_transport import EngineTransport
from engines.json_body import content_bytes

# Property tests check values, not time (speed is for the benchmarks): hypothesis' default
# 200 ms deadline per example failed a round-trip test when the machine stalled for 2 s.
settings.register_profile("splice", deadline=None)
settings.load_profile("splice")


class _HttpxReply:
    """A respx response in the shape of ``engines.http_transport.Reply``."""

    def __init__(self, resp: httpx.Response):
        self._resp = resp
        self.status = resp.status_code

    async def read(self) -> bytes:
        return await self._resp.aread()

    async def lines(self):
        async for line in self._resp.aiter_lines():
            yield line

    def close(self) -> None:
        pass


async def _open_through_respx(self, method, url, *, content, headers, connect_s, read_s, total_s=None):
    """The direct path's ``open`` as an httpx request through ``handle_async_request``, which respx
    has patched: routes see the exact bytes and headers the engine would."""
    timeout = {"connect": connect_s, "read": read_s, "write": read_s, "pool": read_s}
    request = httpx.Request(method, url, content=content_bytes(content), headers=headers, extensions={"timeout": timeout})
    return _HttpxReply(await self.handle_async_request(request))


class EngineTransportMocker(HTTPCoreMocker):
    """respx's default mocker, also patching the engine client's own transport
    (engines/http_transport.py), which never calls httpcore: its httpx transport method, and its
    direct ``open`` routed through that. Only transports are patched, so a test's own ASGI
    client to the proxy app is left alone, as with respx's default."""

    name = "httpcore+engines"
    targets = [*HTTPCoreMocker.targets, "engines.http_transport.EngineTransport"]

    @classmethod
    def start(cls) -> None:
        if cls._patches:
            return
        super().start()
        patch = mock.patch.object(EngineTransport, "open", _open_through_respx)
        patch.start()
        cls._patches.append(patch)

    @classmethod
    def to_httpx_request(cls, **kwargs):
        request = kwargs["request"]
        return request if isinstance(request, httpx.Request) else super().to_httpx_request(**kwargs)

    @classmethod
    async def prepare_async_request(cls, httpx_request, **kwargs):
        if isinstance(kwargs["request"], httpx.Request):
            await httpx_request.aread()
            return httpx_request, kwargs
        return await super().prepare_async_request(httpx_request, **kwargs)

    @classmethod
    async def from_async_httpx_response(cls, httpx_response, target, **kwargs):
        if isinstance(kwargs["request"], httpx.Request):
            return httpx_response
        return await super().from_async_httpx_response(httpx_response, target, **kwargs)


respx.mocks.DEFAULT_MOCKER = EngineTransportMocker.name
