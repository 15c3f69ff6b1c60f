"""Bounded load (admission: a bounded wait, then 429 + Retry-After), total engine deadlines,
and engine credentials that never leave the process."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import pytest
import respx

from engines.http_transport import EngineTransport
from engines.http import Http
from engines.pool import EnginePool
from engines.sglang import SGLangClient
from engines.types import EngineTimeout, SamplingParams
from proxy.app import create_app
from proxy.guard import Admission
from proxy.settings import Settings
from tests.fakes.engines import FakeSGLang, FixedPool, Step
from tokenization import ChatFormat, load_tokenizer, qwen3_tokenizer_dir

TOK = load_tokenizer(str(qwen3_tokenizer_dir()))
OK_IDS = TOK.encode("ok<|im_end|>", add_special_tokens=False)
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


class SlowPool(FixedPool):
    def __init__(self, ids, delay: float):
        super().__init__(ids)
        self.delay = delay
        self.running = 0
        self.peak = 0

    async def generate(self, input_ids, params, *, session_id, on_tokens=None):
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await asyncio.sleep(self.delay)
            return await super().generate(input_ids, params, session_id=session_id, on_tokens=on_tokens)
        finally:
            self.running -= 1


def _app(tmp_path, pool, **kw):
    return create_app(Settings(store=str(tmp_path / "s.sqlite"), max_context=4096, **kw), fmt=ChatFormat(TOK, "qwen3"), pool=pool)


async def _burst(app, n: int, body=CHAT):
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=30) as c:
        rs = await asyncio.gather(*(c.post("/v1/chat/completions", json=body, headers={"X-Session-Id": f"s{i}"}) for i in range(n)))
        metrics = (await c.get("/metrics")).text
    return rs, metrics


# ---------------------------------------------------------------- admission


def test_beyond_max_inflight_waits_then_gets_429_with_retry_after(tmp_path):
    pool = SlowPool(OK_IDS, delay=0.5)
    app = _app(tmp_path, pool, max_inflight=4, admission_wait_s=0.1)
    rs, metrics = asyncio.run(_burst(app, 12))
    ok = [r for r in rs if r.status_code == 200]
    refused = [r for r in rs if r.status_code == 429]
    assert len(ok) == 4 and len(refused) == 8, [r.status_code for r in rs]
    for r in refused:
        assert r.headers["Retry-After"].isdigit()
        err = r.json()["error"]
        assert err["code"] == "saturated" and err["type"] == "rate_limit_error"
    assert pool.peak <= 4
    assert "splice_admission_rejected_total 8.0" in metrics
    assert "splice_admission_active 0.0" in metrics and "splice_admission_waiting 0.0" in metrics


def test_admission_gauges_show_the_turns_running_and_waiting_while_they_do(tmp_path):
    """The gauges are read when /metrics is scraped: mid-burst they count what runs and waits."""
    pool = SlowPool(OK_IDS, delay=0.5)
    app = _app(tmp_path, pool, max_inflight=2, admission_wait_s=5.0)

    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=30) as c:
            turns = [asyncio.create_task(c.post("/v1/chat/completions", json=CHAT, headers={"X-Session-Id": f"s{i}"}))
                     for i in range(5)]  # fmt: skip
            await asyncio.sleep(0.25)
            during = (await c.get("/metrics")).text
            await asyncio.gather(*turns)
            after = (await c.get("/metrics")).text
        return during, after

    during, after = asyncio.run(go())
    assert "splice_admission_active 2.0" in during and "splice_admission_waiting 3.0" in during
    assert "splice_admission_active 0.0" in after and "splice_admission_waiting 0.0" in after


def test_a_bounded_wait_admits_when_a_slot_frees(tmp_path):
    pool = SlowPool(OK_IDS, delay=0.1)
    app = _app(tmp_path, pool, max_inflight=2, admission_wait_s=5.0)
    rs, _ = asyncio.run(_burst(app, 8))
    assert [r.status_code for r in rs] == [200] * 8
    assert pool.peak <= 2


def test_admission_is_fifo_and_survives_cancelled_waiters():
    async def main():
        gate = Admission(1, 5.0)
        assert await gate.acquire()
        order = []

        async def waiter(k):
            if await gate.acquire():
                order.append(k)
                await asyncio.sleep(0.01)
                gate.release()

        tasks = [asyncio.create_task(waiter(k)) for k in range(4)]
        await asyncio.sleep(0.01)
        tasks[1].cancel()  # a client that went away while waiting
        gate.release()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert order == [0, 2, 3]
        assert gate.active == 0 and not gate._waiters

    asyncio.run(main())


def test_a_cancel_landing_as_the_slot_is_handed_over_is_kept_and_the_slot_passed_on():
    """A waiter is handed the slot and cancelled (its client went away, or the server stops)
    before it runs again: it must raise, not run the request, and the slot goes to the next one
    (``asyncio.wait_for`` in Python 3.11 returned the result and dropped the cancel)."""

    async def main():
        gate = Admission(1, 5.0)
        assert await gate.acquire()
        first = asyncio.create_task(gate.acquire())
        second = asyncio.create_task(gate.acquire())
        await asyncio.sleep(0.01)
        gate.release()  # hands the slot to ``first``
        first.cancel()  # before ``first`` resumes
        with pytest.raises(asyncio.CancelledError):
            await first
        assert await asyncio.wait_for(second, 1.0) is True
        assert gate.active == 1 and not gate._waiters
        gate.release()
        assert gate.active == 0

    asyncio.run(main())


def test_default_max_inflight_is_sized_for_the_machine():
    s = Settings()
    assert 256 <= s.max_inflight <= 4096 and s.admission_wait_s > 0


# ---------------------------------------------------------------- body limit on the bytes read


@pytest.mark.parametrize("n_chunks, discard_max", [(63, None), (255, 128 * 1024)])
def test_chunked_upload_without_content_length_is_cut_at_the_limit(tmp_path, monkeypatch, n_chunks, discard_max):
    """Past the limit the body is no longer kept: the rest is read and dropped (so a client still
    uploading reads the 413 rather than a reset), up to a bound, then the 413 goes out."""
    from proxy import guard

    if discard_max is not None:
        monkeypatch.setattr(guard, "DISCARD_MAX_BYTES", discard_max)
    app = _app(tmp_path, FixedPool(OK_IDS), max_request_bytes=64 * 1024)
    read = 0

    async def main():
        nonlocal read
        chunks = [b'{"messages": [{"role": "user", "content": "' + b"a" * 16384] + [b"a" * 16384] * n_chunks + [b'"}]}']
        sent = []

        async def receive():
            nonlocal read
            chunk = chunks.pop(0)
            read += len(chunk)
            return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

        async def send(m):
            sent.append(m)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
                 "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"", "root_path": "",
                 "headers": [(b"content-type", b"application/json"), (b"transfer-encoding", b"chunked")],
                 "client": ("127.0.0.1", 1), "server": ("t", 80)}  # fmt: skip
        await app(scope, receive, send)
        return sent

    sent = asyncio.run(main())
    assert sent[0]["status"] == 413
    assert b"request_too_large" in sent[1]["body"]
    total = 16384 * (n_chunks + 1) + 43 + 4
    if discard_max is None:
        assert read == total  # drained: the client could finish its upload and read the answer
    else:
        assert read <= 64 * 1024 + 16384 + discard_max + 16384 + 64 < total  # the drain is bounded


# ---------------------------------------------------------------- total engine deadline


async def _dripping_server(delay: float):
    """An HTTP server that answers with headers at once, then one body byte every ``delay`` s."""

    async def handle(reader, writer):
        try:
            while (await reader.readline()) not in (b"\r\n", b""):
                pass
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            while True:
                writer.write(b"1\r\n \r\n")
                await writer.drain()
                await asyncio.sleep(delay)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_that_drips_times_out_on_the_total_deadline(stream):
    async def main():
        server, port = await _dripping_server(0.05)  # a read never waits more than 50 ms
        async with server, httpx.AsyncClient(transport=EngineTransport()) as http:
            client = SGLangClient(http, f"http://127.0.0.1:{port}", timeout_s=0.6)
            aborted = []
            client.abort = lambda rid: _record(aborted, rid)
            t0 = time.perf_counter()
            with pytest.raises(EngineTimeout) as err:
                cb = (lambda ids, lps: asyncio.sleep(0)) if stream else None
                await client.generate([1, 2, 3], SamplingParams(max_new_tokens=4), rid="r-drip", on_tokens=cb)
            took = time.perf_counter() - t0
            assert 0.5 < took < 3.0, took
            assert "0.6 s" in str(err.value)
            assert aborted == ["r-drip"]  # the engine is told to drop it
            server.close()

    asyncio.run(main())


async def _record(into, rid):
    into.append(rid)


def test_engine_timeout_flag_reaches_every_client(tmp_path):
    from proxy.cli import _serve_parser, settings_from_args
    import argparse

    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="command")
    _serve_parser(sub)
    args = ap.parse_args(["serve", "--engine-timeout-s", "42", "--max-inflight", "7", "--admission-wait-s", "0.5"])
    s = settings_from_args(args)
    assert (s.engine_timeout_s, s.max_inflight, s.admission_wait_s) == (42.0, 7, 0.5)
    pool = EnginePool("sglang", ["http://e:1"], timeout_s=s.engine_timeout_s, health_interval_s=0)
    assert all(r.client.timeout_s == 42.0 for r in pool._replicas.values())


# ---------------------------------------------------------------- credentials


SECRET_URL = "http://trainer:s3cr3t-pw@engine-a:30000"


@pytest.mark.parametrize("stream", [False, True])
def test_engine_credentials_never_reach_clients_status_or_logs(tmp_path, caplog, stream):
    caplog.set_level(logging.DEBUG)

    async def main():
        with respx.mock(assert_all_called=False) as router:
            engine = FakeSGLang(router, SECRET_URL)
            pool = EnginePool("sglang", [SECRET_URL], health_interval_s=0)
            app = create_app(Settings(store=str(tmp_path / "s.sqlite"), max_context=4096), fmt=ChatFormat(TOK, "qwen3"), pool=pool)
            async with app.router.lifespan_context(app):
                engine.script = [Step(status=500), Step(status=500), Step(status=400)]
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                    r1 = await c.post("/v1/chat/completions", json={**CHAT, "stream": stream})
                    r2 = await c.post("/v1/responses", json={"input": "hi", "stream": stream})
                    status = await c.get("/admin/status")
                    metrics = await c.get("/metrics")
            # the engine saw the credentials (httpx sends them as basic auth)
            assert engine.headers[0]["authorization"].startswith("Basic ")
            return r1, r2, status, metrics

    r1, r2, status, metrics = asyncio.run(main())
    assert r1.status_code == 502 and r2.status_code == 400, (r1.text, r2.text)
    assert "trainer:***@engine-a" in r1.json()["error"]["message"]
    assert status.status_code == 200
    for text in (r1.text, r2.text, status.text, metrics.text, caplog.text):
        assert "s3cr3t-pw" not in text


def test_unreachable_engine_with_credentials_is_a_503_without_them(tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    url = "http://trainer:s3cr3t-pw@127.0.0.1:9"  # discard port: nothing listens

    async def main():
        pool = EnginePool("sglang", [url], health_interval_s=0)
        app = create_app(Settings(store=str(tmp_path / "s.sqlite"), max_context=4096), fmt=ChatFormat(TOK, "qwen3"), pool=pool)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
                return await c.post("/v1/chat/completions", json=CHAT), await c.get("/admin/status")

    r, status = asyncio.run(main())
    assert r.status_code == 503, r.text
    assert r.headers["Retry-After"]
    for text in (r.text, status.text, caplog.text):
        assert "s3cr3t-pw" not in text


def test_http_layer_redacts_in_every_error():
    h = Http(httpx.AsyncClient(transport=EngineTransport()), SECRET_URL)
    assert h.url == "http://trainer:***@engine-a:30000"
