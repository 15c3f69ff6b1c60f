"""Image parts in the three dialects: converted into ``Message`` image parts (decoded once),
refused with a clear 400 in the dialect's error shape when they cannot be used."""

from __future__ import annotations

import argparse
import ipaddress
import base64
import io
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import pytest
from PIL import Image

from engines.reference.vision_files import write_vision_processor_files
from proxy.api.chat import messages_to_conversation as chat_messages
from proxy.api.images import ImageInput, ImageRequest
from proxy.api.messages import messages_to_conversation as anthropic_messages
from proxy.api.responses import input_to_messages, message_from_dict, message_to_dict
from proxy.errors import APIError
from tests.proxy.api.agents_server import serve
from tokenization import ChatFormat, load_tokenizer
from tokenization.vision import ImageLimits, VisionSpec, decode_image


def png(width: int, height: int, seed: int = 0) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr, "RGB").save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


SHOT = png(120, 90, seed=1)
SHOT2 = png(64, 200, seed=2)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_vision_processor_files(tmp_path_factory.mktemp("vl"))


@pytest.fixture(scope="module")
def spec(folder):
    return VisionSpec.from_model_dir(folder)


@pytest.fixture
def images(spec):
    return ImageInput(spec=spec)


def chat_image(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(data), "detail": "high"}}


def responses_image(data: bytes) -> dict:
    return {"type": "input_image", "image_url": data_url(data), "detail": "auto"}


def anthropic_image(data: bytes) -> dict:
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(data).decode()}}


# ============================================================================ unit level


def test_chat_user_and_tool_images(images, spec):
    msgs, _ = chat_messages(
        [
            {"role": "system", "content": "You operate a computer."},
            {"role": "user", "content": [{"type": "text", "text": "Look:"}, chat_image(SHOT), {"type": "text", "text": "What now?"}]},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "shot", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "taken"}, chat_image(SHOT2)]},
        ],
        images.request(),
    )
    want, want2 = decode_image(SHOT, spec), decode_image(SHOT2, spec)
    user, tool = msgs[1], msgs[3]
    assert user.parts == ("Look:", want, "What now?") and user.content == "Look:\nWhat now?"
    assert user.parts[1].data == SHOT and user.parts[1].n_tokens == want.n_tokens
    assert tool.role == "tool" and tool.name == "shot" and tool.parts == ("taken", want2)
    assert not msgs[0].parts and not msgs[2].parts


def test_responses_message_and_tool_outputs(images, spec):
    msgs, _ = input_to_messages(
        [
            {"role": "user", "content": [{"type": "input_text", "text": "Go"}, responses_image(SHOT)]},
            {"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "ok"}, responses_image(SHOT2)]},
            {"type": "function_call", "call_id": "c2", "name": "shot", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c2", "output": responses_image(SHOT)},
            {"type": "computer_call_output", "call_id": "c3", "output": {"type": "computer_screenshot", "image_url": data_url(SHOT2)}},
        ],
        None,
        images.request(),
    )
    a, b = decode_image(SHOT, spec), decode_image(SHOT2, spec)
    assert msgs[0].parts == ("Go", a)
    assert (msgs[2].role, msgs[2].tool_call_id, msgs[2].parts) == ("tool", "c1", ("ok", b))
    assert msgs[4].parts == (a,) and msgs[5].parts == (b,) and msgs[5].tool_call_id == "c3"
    assert images.cache.decodes == 2  # each distinct image decoded once


def test_responses_stored_conversation_keeps_image_references(images, spec):
    msgs, _ = input_to_messages([{"role": "user", "content": [{"type": "input_text", "text": "Go"}, responses_image(SHOT)]}], None, images.request())
    back = message_from_dict(message_to_dict(msgs[0]))
    assert back == msgs[0]  # same text and the same image (hash, size, grid, tokens)
    assert back.parts[1].data == b""  # the bytes live in the image store, by hash


def test_anthropic_user_and_tool_result_images(images, spec):
    msgs, _ = anthropic_messages(
        "sys",
        [
            {"role": "user", "content": [anthropic_image(SHOT), {"type": "text", "text": "Describe it."}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "here"}, anthropic_image(SHOT2)]}, {"type": "text", "text": "and?"}]},
        ],
        images.request(),
    )
    a, b = decode_image(SHOT, spec), decode_image(SHOT2, spec)
    assert [m.role for m in msgs] == ["system", "user", "assistant", "tool", "user"]
    assert msgs[1].parts == (a, "Describe it.")
    assert msgs[3].parts == ("here", b) and msgs[3].tool_call_id == "t1"
    assert msgs[4].content == "and?" and not msgs[4].parts


def test_the_same_pixels_are_one_image_in_every_dialect(images):
    c, _ = chat_messages([{"role": "user", "content": [chat_image(SHOT)]}], images.request())
    r, _ = input_to_messages([{"role": "user", "content": [responses_image(SHOT)]}], None, images.request())
    a, _ = anthropic_messages(None, [{"role": "user", "content": [anthropic_image(SHOT)]}], images.request())
    assert c[0].parts[0].hash == r[0].parts[0].hash == a[0].parts[0].hash


@pytest.mark.parametrize(
    "part,code,words",
    [
        ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "image_url_not_allowed", "--allow-image-urls"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@not base64@@@"}}, "invalid_image", "base64"),
        ({"type": "image_url", "image_url": {"url": data_url(b"just some text")}}, "invalid_image", "not an image"),
        ({"type": "image_url", "image_url": {"url": "data:text/plain;base64,aGk="}}, "invalid_image", "not an image"),
        ({"type": "image_url", "image_url": {"url": "data:image/png,rawbytes"}}, "invalid_image", "base64"),
        ({"type": "image_url", "image_url": {"url": "ftp://x/a.png"}}, "invalid_image", "scheme"),
        ({"type": "image_url", "image_url": {"url": data_url(png(402, 2))}}, "invalid_image", "aspect ratio"),
    ],
)
def test_bad_chat_images_are_400(images, part, code, words):
    with pytest.raises(APIError) as ei:
        chat_messages([{"role": "user", "content": [{"type": "text", "text": "x"}, part]}], images.request())
    e = ei.value
    assert e.status == 400 and e.code == code and e.param.startswith("messages[0].content[1]"), e.body()
    assert words in e.message
    assert e.body()["error"]["type"] == "invalid_request_error"


def test_limits(spec):
    inp = ImageInput(spec=spec, limits=ImageLimits(max_bytes=1000), max_images=2)
    with pytest.raises(APIError) as ei:
        chat_messages([{"role": "user", "content": [chat_image(SHOT)]}], inp.request())
    assert ei.value.code == "image_too_large" and "above the limit" in ei.value.message
    inp = ImageInput(spec=spec, max_images=2)
    with pytest.raises(APIError) as ei:
        chat_messages([{"role": "user", "content": [chat_image(SHOT)] * 3}], inp.request())
    assert ei.value.code == "too_many_images" and ei.value.param == "messages[0].content[2]"
    inp = ImageInput(spec=spec, limits=ImageLimits(max_pixels=100 * 100))
    with pytest.raises(APIError) as ei:
        chat_messages([{"role": "user", "content": [chat_image(SHOT)]}], inp.request())
    assert ei.value.code == "image_too_large" and "pixels" in ei.value.message


def test_file_ids_and_url_sources_are_refused(images):
    with pytest.raises(APIError) as ei:
        input_to_messages([{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}], None, images.request())
    assert ei.value.status == 400 and "data URL" in ei.value.message
    with pytest.raises(APIError) as ei:
        anthropic_messages(None, [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}]}], images.request())
    assert ei.value.code == "image_url_not_allowed"


def test_images_only_where_a_message_takes_them(images):
    with pytest.raises(APIError) as ei:
        chat_messages([{"role": "system", "content": [chat_image(SHOT)]}], images.request())
    assert ei.value.code == "unsupported_content" and "user and tool messages" in ei.value.message
    with pytest.raises(APIError) as ei:
        chat_messages([{"role": "assistant", "content": [chat_image(SHOT)]}], images.request())
    assert ei.value.code == "unsupported_content"


def test_text_only_model_refuses_images():
    with pytest.raises(APIError) as ei:
        chat_messages([{"role": "user", "content": [chat_image(SHOT)]}], ImageInput(spec=None).request())
    assert ei.value.code == "unsupported_content" and "text only" in ei.value.message
    with pytest.raises(APIError):  # no image input at all: the same
        chat_messages([{"role": "user", "content": [chat_image(SHOT)]}])


def test_settings_and_flags(spec):
    from proxy.cli import settings_from_args

    s = settings_from_args(argparse.Namespace(allow_image_urls=True, max_image_bytes=5000, max_images_per_request=3, max_image_pixels=10**6))
    inp = ImageInput.from_settings(s, spec)
    assert (inp.allow_urls, inp.limits.max_bytes, inp.max_images, inp.limits.max_pixels) == (True, 5000, 3, 10**6)
    d = ImageInput.from_settings(settings_from_args(argparse.Namespace()), spec)
    assert (d.allow_urls, d.limits.max_bytes, d.max_images) == (False, 20 * 1024 * 1024, 64)


def test_cli_finds_the_vision_spec_in_the_model_folder(folder):
    from proxy.cli import _build_proxy
    from proxy.settings import Settings
    from tokenization import qwen3_tokenizer_dir

    _, fmt, _ = _build_proxy(Settings(), ["http://127.0.0.1:9"], str(folder), None)
    assert fmt.vision is not None and fmt.vision.image_pad_id == 151655
    _, fmt, _ = _build_proxy(Settings(), ["http://127.0.0.1:9"], str(qwen3_tokenizer_dir()), None)
    assert fmt.vision is None


# ============================================================================ over HTTP


@pytest.fixture(scope="module")
def vision_server(folder, spec):
    from tokenization.loader import make_renderer

    tok = load_tokenizer(str(folder))
    images = ImageInput(spec=spec, limits=ImageLimits(max_bytes=200_000))
    with serve(tok, make_renderer(tok, "qwen3"), fmt=ChatFormat(tok, "qwen3", vision=spec), images=images) as handle:
        yield handle


@pytest.fixture
def vlive(vision_server):
    vision_server.runner.reset()
    vision_server.images.allow_urls = False
    return vision_server


@pytest.fixture(scope="module")
def image_host():
    """A loopback HTTP server with one image, a too-large one and a 404."""
    big = png(400, 400, seed=9)
    assert len(big) > 200_000

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = {"/shot.png": SHOT, "/big.png": big}.get(self.path)
            if body is None:
                self.send_response(404)
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("content-type", "image/png")
            self.end_headers()  # no content-length: the size limit is enforced while reading
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_http_all_three_dialects_carry_the_image(vlive, spec):
    want = decode_image(SHOT, spec)
    r = httpx.post(vlive.base_url + "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, chat_image(SHOT)]}]})
    assert r.status_code == 200, r.text
    r = httpx.post(vlive.base_url + "/v1/responses", json={"model": "m", "input": [{"role": "user", "content": [responses_image(SHOT)]}]})
    assert r.status_code == 200, r.text
    r = httpx.post(vlive.base_url + "/v1/messages", json={"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [anthropic_image(SHOT)]}]})
    assert r.status_code == 200, r.text
    got = [req.messages[-1].images for req in vlive.runner.requests]
    assert got == [(want,), (want,), (want,)]
    assert all(req.messages[-1].images[0].data == SHOT for req in vlive.runner.requests)


def test_http_resent_images_are_not_decoded_again(vlive):
    cache = vlive.images.cache
    body = {"model": "m", "messages": [{"role": "user", "content": [chat_image(SHOT2)]}]}
    httpx.post(vlive.base_url + "/v1/chat/completions", json=body).raise_for_status()
    before = cache.decodes
    for _ in range(3):
        httpx.post(vlive.base_url + "/v1/chat/completions", json=body).raise_for_status()
    assert cache.decodes == before


def test_http_count_tokens_counts_the_expanded_image(vlive, spec):
    info = decode_image(SHOT, spec)
    base = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    with_image = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, anthropic_image(SHOT)]}]}
    n0 = httpx.post(vlive.base_url + "/v1/messages/count_tokens", json=base).json()["input_tokens"]
    n1 = httpx.post(vlive.base_url + "/v1/messages/count_tokens", json=with_image).json()["input_tokens"]
    assert n1 - n0 == info.n_tokens + 2  # the span plus <|vision_start|> and <|vision_end|>


def test_http_bad_images_are_400_and_nothing_runs(vlive):
    bad = [
        ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, "image_url_not_allowed"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}}, "invalid_image"),
        ({"type": "image_url", "image_url": {"url": data_url(b"GIF89a-but-not-really")}}, "invalid_image"),
        ({"type": "image_url", "image_url": {"url": data_url(png(400, 400, seed=9))}}, "image_too_large"),
    ]
    for part, code in bad:
        r = httpx.post(vlive.base_url + "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": [part]}]})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == code and err["type"] == "invalid_request_error" and err["param"] == "messages[0].content[0]", err
        assert err["message"]
    r = httpx.post(vlive.base_url + "/v1/responses", json={"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,!!"}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].content[0]"
    # Anthropic's error shape under /v1/messages
    r = httpx.post(vlive.base_url + "/v1/messages", json={"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}]}]})
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error" and "--allow-image-urls" in body["error"]["message"]
    too_many = {"model": "m", "messages": [{"role": "user", "content": [chat_image(SHOT)] * 65}]}
    r = httpx.post(vlive.base_url + "/v1/chat/completions", json=too_many)
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_images"
    assert vlive.runner.requests == []  # no turn ran, nothing was recorded


def test_http_image_urls_fetched_only_when_allowed(vlive, image_host, spec):
    body = lambda path: {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_host + path}}]}]}  # noqa: E731
    r = httpx.post(vlive.base_url + "/v1/chat/completions", json=body("/shot.png"))
    assert r.status_code == 400 and r.json()["error"]["code"] == "image_url_not_allowed"
    vlive.images.allow_urls = True
    r = httpx.post(vlive.base_url + "/v1/chat/completions", json=body("/shot.png"))
    assert r.status_code == 400 and "could not be fetched" in r.text  # loopback: refused
    vlive.images.allow_nets = (ipaddress.ip_network("127.0.0.1/32"),)  # --image-url-allow-net 127.0.0.1
    try:
        r = httpx.post(vlive.base_url + "/v1/chat/completions", json=body("/shot.png"))
        assert r.status_code == 200, r.text
        assert vlive.runner.requests[-1].messages[-1].images[0].hash == decode_image(SHOT, spec).hash
        # too large and missing: the same message as any other failure (nothing about what answered)
        for path in ("/big.png", "/missing.png"):
            r = httpx.post(vlive.base_url + "/v1/chat/completions", json=body(path))
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_image", r.text
            assert "the image URL could not be fetched as an image" in r.json()["error"]["message"]
    finally:
        vlive.images.allow_nets = ()
    assert len(vlive.runner.requests) == 1


def test_text_only_server_still_refuses_images(live):
    r = httpx.post(live.base_url + "/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": [chat_image(SHOT)]}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_content"
    assert live.runner.requests == []


def test_image_request_without_prepare_decodes_inline(images):
    req = ImageRequest(images)
    msgs, _ = chat_messages([{"role": "user", "content": [chat_image(SHOT)]}], req)
    assert req.count == 1 and msgs[0].images[0].data == SHOT


def test_http_odd_bodies_are_400_not_500(vlive):
    odd = [
        {"model": "m", "messages": [{"role": "user", "content": [{"type": ["image_url"], "image_url": {"url": "x"}}]}]},
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": 5}}]}]},
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": None}]}]},
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}],
    ]
    for body in odd:
        r = httpx.post(vlive.base_url + "/v1/chat/completions", json=body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["message"]
    r = httpx.post(vlive.base_url + "/v1/messages", json={"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": "x"}]}]})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert vlive.runner.requests == []
