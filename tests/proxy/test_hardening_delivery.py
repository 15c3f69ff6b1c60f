"""A client that goes away cancels its turn: the engine request is aborted (SGLang
``/abort_request`` with its ``rid``), the session lock is released, the session's next turn
runs, and no training sample ever contains output nobody received.

The app is driven through raw ASGI calls so the test decides exactly when the client
disconnects, and how the app learns of it: from ``receive()`` (any ASGI server) or from the
callback Splice's own server protocol puts in the scope (proxy/http_server.py). The engine is a
scripted SGLang on respx whose first generation hangs."""

from __future__ import annotations

import asyncio
import json

import httpx
import orjson
import pytest
import respx

from engines.pool import EnginePool
from proxy.app import create_app
from proxy.http_server import DISCONNECT, Disconnect
from proxy.settings import Settings
from tests.fakes.engines import FakeSGLang, Step, sglang_reply, sse
from tokenization import ChatFormat, load_tokenizer, qwen3_tokenizer_dir

TOK = load_tokenizer(str(qwen3_tokenizer_dir()))
URL = "http://engine-a:30000"
REPLY = TOK.encode("fine<|im_end|>", add_special_tokens=False)
ABANDONED_REPLY = TOK.encode("never seen<|im_end|>", add_special_tokens=False)


class HangingSGLang(FakeSGLang):
    """The first ``hang`` generations stream one token, then hang until cancelled; the rest
    answer at once."""

    def __init__(self, router, url, hang: int = 1):
        super().__init__(router, url)
        self.hang = hang
        self.started = asyncio.Event()
        self.generate_route.side_effect = self._gen

    async def _gen(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.requests.append(body)
        if self.hang > 0:
            self.hang -= 1

            async def drip():
                step = Step(tokens=[(ABANDONED_REPLY[0], -0.1)], finish="stop")
                frame = sglang_reply(body["input_ids"], step, final=False, rid=body["rid"])
                yield b"data: " + orjson.dumps(frame) + b"\n\n"
                self.started.set()
                await asyncio.sleep(3600)

            if body["stream"]:
                return httpx.Response(200, content=drip(), headers={"content-type": "text/event-stream"})
            self.started.set()
            await asyncio.sleep(3600)
        step = Step(tokens=[(t, -0.2) for t in REPLY], finish="stop", matched=REPLY[-1])
        if body["stream"]:
            frames = [sglang_reply(body["input_ids"], step, rid=body["rid"])]
            return httpx.Response(200, content=sse(frames), headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json=sglang_reply(body["input_ids"], step, rid=body["rid"]))

    @property
    def aborted(self) -> list[str]:
        return [b["rid"] for path, b in self.admin if path == "/abort_request"]


class Client:
    """One ASGI request; ``disconnect`` makes ``receive`` report the client gone; with
    ``server_hook`` it first fires the scope's ``Disconnect``, as Splice's server does, and
    ``receive`` reports it only if ``receive_reports`` (a non-streamed turn must learn of it from
    the hook alone; a started stream still reads ``receive``)."""

    def __init__(self, app, path: str, body: dict, headers: dict[str, str] | None = None, *, server_hook: bool = False,
                 receive_reports: bool = True):  # fmt: skip
        self.app, self.path = app, path
        self.hook = Disconnect() if server_hook else None
        self.receive_reports = receive_reports
        self.body = orjson.dumps(body)
        self.headers = [(b"content-type", b"application/json"), (b"content-length", str(len(self.body)).encode())]
        self.headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        self.gone = asyncio.Event()
        self.sent: list[dict] = []
        self.block_on: bytes | None = None  # a body chunk containing this never completes its send

    def disconnect(self) -> None:
        if self.hook is not None:
            self.hook.fire()
        if self.receive_reports:
            self.gone.set()

    async def __call__(self) -> list[dict]:
        first = True

        async def receive():
            nonlocal first
            if first:
                first = False
                return {"type": "http.request", "body": self.body, "more_body": False}
            await self.gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if self.block_on is not None and self.block_on in message.get("body", b""):
                self.gone.set()  # the client is gone while this chunk is being written
                await asyncio.sleep(3600)
            self.sent.append(message)

        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1", "method": "POST",
            "scheme": "http", "path": self.path, "raw_path": self.path.encode(), "query_string": b"", "root_path": "",
            "headers": self.headers, "client": ("127.0.0.1", 5000), "server": ("testserver", 80),
        }  # fmt: skip
        if self.hook is not None:
            scope["extensions"] = {DISCONNECT: self.hook}
        await self.app(scope, receive, send)
        return self.sent

    @property
    def status(self) -> int | None:
        return next((m["status"] for m in self.sent if m["type"] == "http.response.start"), None)

    @property
    def text(self) -> str:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body").decode()


def run(coro):
    return asyncio.run(coro)


async def _with_app(tmp_path, body_fn, hang: int = 1):
    with respx.mock(assert_all_called=False) as router:
        engine = HangingSGLang(router, URL, hang=hang)
        pool = EnginePool("sglang", [URL], health_interval_s=0)
        app = create_app(Settings(store=str(tmp_path / "s.sqlite"), max_context=4096), fmt=ChatFormat(TOK, "qwen3"), pool=pool)
        async with app.router.lifespan_context(app):
            await body_fn(app, engine)


def samples_of(app, session_id: str, reward: float = 1.0) -> list[dict]:
    store = app.state.store
    store.sessions.set_reward(session_id, reward)
    _lease, samples = store.pool.pull(100, 60.0)
    return [s for s in samples if s["session_id"] == session_id]


def first_turn(path: str, stream: bool) -> dict:
    if path == "/v1/responses":
        return {"input": "hello", "stream": stream}
    extra = {"max_tokens": 512} if path == "/v1/messages" else {}
    return {"messages": [{"role": "user", "content": "hello"}], "stream": stream, **extra}


def second_turn(path: str, stream: bool, first_text: str) -> dict:
    if path == "/v1/responses":
        return {"input": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": first_text},
                          {"role": "user", "content": "again"}], "stream": stream}  # fmt: skip
    extra = {"max_tokens": 512} if path == "/v1/messages" else {}
    return {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": first_text},
                         {"role": "user", "content": "again"}], "stream": stream, **extra}  # fmt: skip


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/messages"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("server_hook", [False, True], ids=["receive", "server-hook"])
def test_disconnect_mid_generation_aborts_releases_and_trains_on_nothing_unseen(tmp_path, path, stream, server_hook):
    async def body(app, engine):
        h = {"X-Session-Id": "s1"}
        gone = Client(app, path, first_turn(path, stream), h, server_hook=server_hook, receive_reports=stream or not server_hook)
        task = asyncio.create_task(gone())
        await asyncio.wait_for(engine.started.wait(), 10)
        gone.disconnect()
        await asyncio.wait_for(task, 10)
        # the engine request was aborted by its rid, nothing was committed
        await asyncio.sleep(0.05)
        assert engine.aborted == [engine.requests[0]["rid"]], engine.admin
        assert app.state.store.stats()["turns"] == 0
        assert app.state.runner.metrics.inflight._value.get() == 0
        # the session's next turn runs (the lock was released) and is delivered
        ok = Client(app, path, first_turn(path, stream), h)
        await asyncio.wait_for(ok(), 10)
        assert ok.status == 200, ok.text
        assert "fine" in ok.text
        ok2 = Client(app, path, second_turn(path, stream, "fine"), h)
        await asyncio.wait_for(ok2(), 10)
        assert ok2.status == 200, ok2.text
        samples = samples_of(app, "s1")
        ids = [t for s in samples for t, m in zip(s["input_ids"], s["loss_mask"]) if m]
        assert ABANDONED_REPLY[0] not in ids
        assert len(ids) == 2 * len(REPLY)

    run(_with_app(tmp_path, body))


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/messages"])
def test_turn_committed_but_final_event_never_sent_is_abandoned(tmp_path, path):
    """The runner commits before the final event; if that event never reaches the transport,
    the turn is marked abandoned and sample assembly skips it."""

    async def body(app, engine):
        h = {"X-Session-Id": "s2"}
        c = Client(app, path, first_turn(path, True), h)
        c.block_on = {"/v1/responses": b"response.completed", "/v1/messages": b"message_stop"}.get(path, b"[DONE]")
        await asyncio.wait_for(c(), 10)
        for _ in range(100):
            if app.state.store.turns.list("s2") and app.state.store.turns.list("s2")[0].abandoned:
                break
            await asyncio.sleep(0.02)
        turns = app.state.store.turns.list("s2")
        assert len(turns) == 1 and turns[0].abandoned
        assert samples_of(app, "s2") == []
        assert "splice_abandoned_turns_total 1.0" in (await _metrics(app))

    run(_with_app(tmp_path, body, hang=0))


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/messages"])
def test_delivered_turns_are_trained_on(tmp_path, path):
    async def body(app, engine):
        h = {"X-Session-Id": "s3"}
        for stream in (False, True):
            c = Client(app, path, first_turn(path, stream) if not stream else second_turn(path, True, "fine"), h)
            await asyncio.wait_for(c(), 10)
            assert c.status == 200, c.text
        turns = app.state.store.turns.list("s3")
        assert [t.abandoned for t in turns] == [False, False]
        assert sum(sum(s["loss_mask"]) for s in samples_of(app, "s3")) == 2 * len(REPLY)

    run(_with_app(tmp_path, body, hang=0))


async def _metrics(app) -> str:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        return (await c.get("/metrics")).text


def test_a_client_gone_mid_turn_over_real_http_aborts_and_stores_nothing(tmp_path):
    """The same over a real uvicorn server with Splice's protocol (proxy/http_server.py): the
    client closes its socket mid-generation; the server's disconnect callback cancels the turn
    running in the request's own task: the engine request is aborted, nothing is stored, and
    the session's next turn runs."""
    import socket
    import time

    from proxy.http_server import server_options
    from tests.fakes.serve import serve_in_thread

    with respx.mock(assert_all_called=False) as router:
        engine = HangingSGLang(router, URL, hang=1)
        router.route(host="127.0.0.1").pass_through()  # the test's own requests to the server
        app = create_app(Settings(store=str(tmp_path / "s.sqlite"), max_context=4096), fmt=ChatFormat(TOK, "qwen3"),
                         pool=EnginePool("sglang", [URL], health_interval_s=0))  # fmt: skip
        url, stop = serve_in_thread(app, **server_options(65536, 10.0, 5.0))
        try:
            body = orjson.dumps(first_turn("/v1/chat/completions", False))
            head = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
                    b"x-session-id: s9\r\ncontent-length: %d\r\n\r\n" % len(body))  # fmt: skip
            with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as c:
                c.sendall(head + body)
                deadline = time.monotonic() + 10
                while not engine.started.is_set() and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert engine.started.is_set()
            deadline = time.monotonic() + 10
            while not engine.aborted and time.monotonic() < deadline:
                time.sleep(0.01)
            assert engine.aborted == [engine.requests[0]["rid"]], engine.admin
            r = httpx.post(url + "/v1/chat/completions", json=first_turn("/v1/chat/completions", False),
                           headers={"X-Session-Id": "s9"}, timeout=30)  # fmt: skip
            assert r.status_code == 200 and "fine" in r.text, r.text
            turns = app.state.store.turns.list("s9")
            assert len(turns) == 1 and not turns[0].abandoned  # only the delivered turn
        finally:
            stop()
