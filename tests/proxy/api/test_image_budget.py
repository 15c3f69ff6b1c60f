"""What images may cost: one request's images together stay under ``max_request_image_pixels``
(the image over the budget is refused from its header, before its pixels are decoded), and at
most ``image_decode_concurrency`` decodes run at once in the whole proxy, however many requests
bring images; a cache hit never waits for a decode slot. Real PNGs, real decoding."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from proxy.api.chat import messages_to_conversation as chat_messages
from proxy.api.images import ImageInput
from proxy.errors import APIError
from proxy.settings import Settings
from tests.proxy.api.test_images_input import chat_image, folder, png, spec  # noqa: F401 - fixtures

BIG = [png(1200, 1200, seed=40 + i) for i in range(6)]  # 1.44 Mpixel each, distinct pixels


class CountingSlots:
    """The proxy's decode semaphore, counting how many decodes hold it at once."""

    def __init__(self, inner):
        self.inner = inner
        self.active = 0
        self.most = 0
        self.lock = threading.Lock()

    def __enter__(self):
        self.inner.acquire()
        with self.lock:
            self.active += 1
            self.most = max(self.most, self.active)
        time.sleep(0.05)  # hold it a little, so overlapping decodes overlap for sure
        return self

    def __exit__(self, *exc):
        with self.lock:
            self.active -= 1
        self.inner.release()


def _request(images: ImageInput, shots: list[bytes]):
    async def go():
        content = [chat_image(s) for s in shots]
        body = {"messages": [{"role": "user", "content": content}]}
        req = await images.prepare(body)
        return chat_messages(body["messages"], req)

    return go()


def test_a_request_over_its_pixel_budget_is_refused(spec):  # noqa: F811
    images = ImageInput.from_settings(Settings(max_request_image_pixels=3_000_000), spec)
    (msg,), _ = asyncio.run(_request(images, BIG[:2]))  # 2.88 M: within
    assert len(msg.images) == 2
    decodes = images.cache.decodes
    with pytest.raises(APIError) as ei:
        asyncio.run(_request(images, [BIG[2], BIG[3], BIG[4]]))  # the third would make 4.32 M
    assert ei.value.status == 400 and ei.value.code == "image_too_large"
    assert "3,000,000 pixels together" in ei.value.message and "max_request_image_pixels" in ei.value.message
    assert images.cache.decodes == decodes + 2  # the third was refused from its header, never decoded
    with pytest.raises(APIError):  # inline decoding (no prepare) keeps the same budget
        chat_messages([{"role": "user", "content": [chat_image(s) for s in BIG[2:5]]}], images.request())


def test_concurrent_decodes_are_bounded_proxy_wide(spec):  # noqa: F811
    images = ImageInput.from_settings(Settings(image_decode_concurrency=2), spec)
    slots = images.cache.decode_slots = CountingSlots(images.cache.decode_slots)

    async def many():
        return await asyncio.gather(*(_request(images, [b]) for b in BIG))

    out = asyncio.run(many())
    assert len(out) == 6 and images.cache.decodes == 6
    assert slots.most == 2, slots.most  # six requests at once, two decodes at a time

    # a cache hit does not wait for a slot: with both slots held, a resent image still converts
    slots.inner.acquire()
    slots.inner.acquire()
    try:
        (msg,), _ = asyncio.run(asyncio.wait_for(_request(images, [BIG[0]]), 10))
        assert msg.images  # (wait_for: it did not wait behind the held slots)
    finally:
        slots.inner.release()
        slots.inner.release()


def test_peak_memory_is_the_decode_slots_times_one_image():
    """``proxy.bench.image_memory`` in fresh processes (real decodes, the proxy's own image path):
    4 requests at once with one decode slot peak like one image, not like four, and hold
    nothing after; two slots peak like two images. Relative to one image, so not a timing."""
    import json
    import subprocess
    import sys

    def peak(n: int, c: int) -> dict:
        out = subprocess.run([sys.executable, "-m", "proxy.bench.image_memory", "--child", "--n", str(n), "--pixels", "25000000",
                              "--concurrency", str(c)], capture_output=True, text=True, check=True, timeout=600)  # fmt: skip
        return json.loads(out.stdout.strip().splitlines()[-1])

    one = peak(1, 1)["peak_mb"]
    assert one > 25_000_000 * 10 / 2**20  # a 5000 x 5000 decode really ran (~13.4 bytes per pixel)
    four = peak(4, 1)
    assert four["peak_mb"] < 1.3 * one, (one, four)  # four at once would be ~4x; retained heaps were 2.7x
    assert four["held_mb"] < 0.2 * one, (one, four)
    assert peak(4, 2)["peak_mb"] < 2.3 * one
