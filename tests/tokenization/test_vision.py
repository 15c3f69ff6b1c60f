"""Image decoding, grids and placeholder counts, checked against transformers' own Qwen2-VL
image processor (``Qwen2VLImageProcessorPil``, built from the same preprocessor_config.json)."""

from __future__ import annotations

import io
import json
import random
import zlib
import struct

import numpy as np
import pytest
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from engines.reference.vision_files import IMAGE_PAD_ID, VISION_END_ID, VISION_START_ID, write_vision_processor_files
from tokenization.vision import (
    ImageCache,
    ImageError,
    ImageLimits,
    VisionSpec,
    decode_image,
    expand_image_pads,
    find_image_spans,
    image_spans,
)


def processor_of(folder) -> Qwen2VLImageProcessorPil:
    cfg = json.loads((folder / "preprocessor_config.json").read_text())
    return Qwen2VLImageProcessorPil(**{k: v for k, v in cfg.items() if k not in ("image_processor_type", "processor_class")})


def png(width: int, height: int, seed: int = 0, mode: str = "RGB") -> bytes:
    rng = np.random.default_rng(seed)
    chans = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    arr = rng.integers(0, 256, size=(height, width, chans), dtype=np.uint8)
    img = Image.fromarray(arr[..., 0] if chans == 1 else arr, mode)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Three processor settings: the tiny model's, a tight max (downscales) and a high min (upscales)."""
    out = {}
    for name, kw in {
        "default": {},
        "small_max": {"max_pixels": 64 * 28 * 28},
        "large_min": {"min_pixels": 512 * 28 * 28, "max_pixels": 1024 * 28 * 28},
    }.items():
        out[name] = write_vision_processor_files(tmp_path_factory.mktemp(name), **kw)
    return out


def test_spec_from_model_dir(folders, tmp_path):
    spec = VisionSpec.from_model_dir(folders["default"])
    assert (spec.image_pad_id, spec.vision_start_id, spec.vision_end_id) == (IMAGE_PAD_ID, VISION_START_ID, VISION_END_ID)
    assert set(spec.banned_ids) == {151652, 151653, 151654, 151655, 151656}
    assert (spec.min_pixels, spec.max_pixels) == (4 * 28 * 28, 256 * 28 * 28)
    assert VisionSpec.from_model_dir(tmp_path) is None  # no preprocessor_config.json: text-only
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": "CLIPImageProcessor"}))
    assert VisionSpec.from_model_dir(tmp_path) is None


SIZES = [(100, 150), (150, 100), (28, 28), (1, 1), (3, 200), (200, 1), (1920, 1080), (1080, 1920), (1280, 800),
         (2560, 1440), (4000, 21), (20, 3999), (57, 57), (56, 84), (333, 777), (640, 480), (13, 2600), (999, 1001)]  # fmt: skip


@pytest.mark.parametrize("setting", ["default", "small_max", "large_min"])
def test_grid_and_count_equal_the_processor(folders, setting):
    folder = folders[setting]
    spec = VisionSpec.from_model_dir(folder)
    proc = processor_of(folder)
    rng = random.Random(7)
    sizes = SIZES + [(rng.randint(1, 3000), rng.randint(1, 3000)) for _ in range(30)]
    checked = 0
    for w, h in sizes:
        if max(w, h) / min(w, h) > 200:
            continue
        ref = proc(images=[Image.new("RGB", (w, h), (10, 20, 30))], return_tensors="np")
        grid = tuple(int(x) for x in ref["image_grid_thw"][0])
        assert spec.grid(w, h) == grid, (w, h)
        # the processor emits one patch row per grid cell; merge_size**2 of them make one token
        assert spec.n_tokens(grid) == ref["pixel_values"].shape[0] // spec.merge_size**2
        checked += 1
    assert checked >= 40


def test_tiny_image_is_scaled_up_to_min_pixels(folders):
    spec = VisionSpec.from_model_dir(folders["large_min"])
    t, h, w = spec.grid(10, 10)
    assert h * w * 14 * 14 >= spec.min_pixels


def test_aspect_ratio_beyond_200_is_refused_like_the_processor(folders):
    spec = VisionSpec.from_model_dir(folders["default"])
    proc = processor_of(folders["default"])
    with pytest.raises(ValueError):
        proc(images=[Image.new("RGB", (402, 2))], return_tensors="np")
    with pytest.raises(ImageError, match="aspect ratio"):
        decode_image(png(402, 2), spec)
    assert decode_image(png(400, 2), spec).grid_thw == spec.grid(400, 2)


def test_decode_reports_size_format_and_hash(folders):
    spec = VisionSpec.from_model_dir(folders["default"])
    data = png(100, 150)
    info = decode_image(data, spec)
    assert (info.mime, info.width, info.height) == ("image/png", 100, 150)
    assert info.grid_thw == (1, 10, 8) and info.n_tokens == 20
    assert info.data == data
    assert len(info.hash) == 64


def _reencode(data: bytes, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    Image.open(io.BytesIO(data)).save(buf, format=fmt, **kw)
    return buf.getvalue()


def test_hash_is_over_pixels_not_encoding(folders):
    spec = VisionSpec.from_model_dir(folders["default"])
    data = png(64, 48, seed=1)
    webp = _reencode(data, "WEBP", lossless=True)
    png_max = _reencode(data, "PNG", compress_level=9)
    assert webp != data and png_max != data
    a, b, c = (decode_image(x, spec) for x in (data, webp, png_max))
    assert a.hash == b.hash == c.hash
    assert (a.mime, b.mime) == ("image/png", "image/webp")
    other = decode_image(png(64, 48, seed=2), spec)
    assert other.hash != a.hash
    # one pixel changed
    img = Image.open(io.BytesIO(data)).convert("RGB")
    px = img.getpixel((3, 3))
    img.putpixel((3, 3), ((px[0] + 1) % 256, px[1], px[2]))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    assert decode_image(buf.getvalue(), spec).hash != a.hash
    # same pixels, different shape: different hash
    arr = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    buf = io.BytesIO()
    Image.fromarray(arr.reshape(48 * 2, 32, 3)).save(buf, format="PNG")
    assert decode_image(buf.getvalue(), spec).hash != a.hash


def test_transparency_hashes_as_the_processor_sees_it(folders):
    """Two images differing only in alpha look different to the model (alpha is composited
    onto white), so they must not share a hash."""
    spec = VisionSpec.from_model_dir(folders["default"])
    arr = np.zeros((20, 20, 4), dtype=np.uint8)
    arr[..., 3] = 255
    opaque = Image.fromarray(arr, "RGBA")
    arr2 = arr.copy()
    arr2[..., 3] = 0
    clear = Image.fromarray(arr2, "RGBA")
    encoded = []
    for img in (opaque, clear):
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        encoded.append(buf.getvalue())
    assert decode_image(encoded[0], spec).hash != decode_image(encoded[1], spec).hash
    # an opaque RGBA image is the same picture as its RGB version
    buf = io.BytesIO()
    opaque.convert("RGB").save(buf, format="PNG")
    assert decode_image(buf.getvalue(), spec).hash == decode_image(encoded[0], spec).hash


def test_decode_errors(folders):
    spec = VisionSpec.from_model_dir(folders["default"])
    with pytest.raises(ImageError, match="empty"):
        decode_image(b"", spec)
    with pytest.raises(ImageError, match="not an image"):
        decode_image(b"hello, not an image at all", spec)
    with pytest.raises(ImageError, match="cannot be decoded"):
        decode_image(png(64, 64)[:200], spec)  # truncated pixel data
    with pytest.raises(ImageError, match="bytes, above the limit"):
        decode_image(png(64, 64), spec, ImageLimits(max_bytes=100))
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="BMP")
    with pytest.raises(ImageError, match="format BMP is not supported"):
        decode_image(buf.getvalue(), spec)
    with pytest.raises(ImageError, match="pixels, above the limit") as ei:
        decode_image(png(300, 300), spec, ImageLimits(max_pixels=300 * 299))
    assert ei.value.code == "image_too_large"
    with pytest.raises(ImageError) as ei:
        decode_image(b"GIF89a nonsense", spec)
    assert ei.value.code == "invalid_image"


def test_decompression_bomb_is_refused_before_decoding(folders):
    """A tiny PNG declaring 60000 x 60000 pixels: refused from its header."""
    spec = VisionSpec.from_model_dir(folders["default"])

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

    w = h = 60000
    row = b"\x00" + b"\x00" * w  # filter byte + one byte per pixel (greyscale)
    comp = zlib.compressobj(9)
    idat = b"".join(comp.compress(row) for _ in range(64)) + comp.flush()  # only the first rows
    bomb = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0)) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
    assert len(bomb) < 100_000
    with pytest.raises(ImageError, match="pixels"):
        decode_image(bomb, spec)


def test_cache_decodes_each_encoding_once(folders):
    spec = VisionSpec.from_model_dir(folders["default"])
    cache = ImageCache(max_entries=3)
    shots = [png(40, 30, seed=s) for s in range(4)]
    first = cache.decode(shots[0], spec)
    for _ in range(5):  # an agent resending its history every turn
        assert cache.decode(shots[0], spec) is first
    assert cache.decodes == 1 and cache.hits == 5
    for s in shots[1:]:
        cache.decode(s, spec)
    assert cache.decodes == 4 and len(cache) == 3  # bounded: the oldest went out
    cache.decode(shots[0], spec)
    assert cache.decodes == 5
    with pytest.raises(ImageError):  # a cached image is still checked against the limits given
        cache.decode(shots[1], spec, ImageLimits(max_pixels=100))
    bad = b"not an image"
    for _ in range(2):
        with pytest.raises(ImageError):
            cache.decode(bad, spec)
    cache2 = ImageCache(max_entries=100, max_bytes=2 * len(shots[0]) + 10)
    for s in shots:
        cache2.decode(s, spec)
    assert len(cache2) <= 2  # bounded by bytes held too


def test_spans_and_expansion(folders):
    spec = VisionSpec.from_model_dir(folders["default"])
    a, b = decode_image(png(100, 150), spec), decode_image(png(300, 60, seed=3), spec)
    ids = [1, VISION_START_ID, IMAGE_PAD_ID, VISION_END_ID, 2, VISION_START_ID, IMAGE_PAD_ID, VISION_END_ID]
    out = expand_image_pads(ids, [a, b], IMAGE_PAD_ID)
    assert len(out) == len(ids) - 2 + a.n_tokens + b.n_tokens
    assert find_image_spans(out, spec, base=10) == [(12, a.n_tokens), (12 + a.n_tokens + 3, b.n_tokens)]
    spans = image_spans(out, [a, b], spec)
    assert [(s.hash, s.offset, s.length) for s in spans] == [(a.hash, 2, a.n_tokens), (b.hash, 2 + a.n_tokens + 3, b.n_tokens)]
    with pytest.raises(ImageError):
        expand_image_pads(ids, [a], IMAGE_PAD_ID)
    with pytest.raises(ImageError):
        image_spans(out, [b, a], spec)  # lengths do not match the images in that order


def test_cache_by_text_skips_even_the_base64_decode(folders):
    import base64

    spec = VisionSpec.from_model_dir(folders["default"])
    cache = ImageCache(max_entries=2)
    calls = []

    def to_bytes(text: str) -> bytes:
        calls.append(text)
        return base64.b64decode(text)

    a, b, c = (base64.b64encode(png(30, 30, seed=s)).decode() for s in (1, 2, 3))
    first = cache.decode_text(a, to_bytes, spec)
    assert cache.decode_text(a, to_bytes, spec) is first and len(calls) == 1 and cache.decodes == 1
    # the same image as raw bytes is the same cache entry
    assert cache.decode(base64.b64decode(a), spec) is first and cache.decodes == 1
    cache.decode_text(b, to_bytes, spec)
    cache.decode_text(c, to_bytes, spec)  # evicts a
    assert cache.decode_text(a, to_bytes, spec).hash == first.hash
    assert cache.decodes == 4 and len(calls) == 4  # evicted: decoded again, not served stale
