"""Settings every test shares."""

import httpx
import respx.mocks
from respx.mocks import HTTPCoreMocker


class EngineTransportMocker(HTTPCoreMocker):
    """respx's default mocker, also patching the engine client's aiohttp transport
    (engines/http_transport.py), which never calls httpcore. Only transports are patched, so a
    test's own ASGI client to the proxy app is left alone, as with respx's default."""

    name = "httpcore+engines"
    targets = [*HTTPCoreMocker.targets, "engines.http_transport.AiohttpTransport"]

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
