"""Images for Qwen2-VL-family models: processor settings, placeholder counts, decoding, a cache.

Torch-free (Pillow only), so the proxy can decode and count without the trainer's stack.

* ``VisionSpec``: the image processor's settings (``preprocessor_config.json``) and the
  tokenizer's vision token ids. Fixed per proxy, so an image expands to the same number of
  ``<|image_pad|>`` tokens on every turn of a session.
* ``VisionSpec.grid`` is Qwen2-VL's ``smart_resize`` followed by the patch grid, as
  ``Qwen2VLImageProcessor`` computes ``image_grid_thw``; ``n_tokens`` is
  ``grid_t * grid_h * grid_w / merge_size**2``.
* ``decode_image`` checks and decodes one encoded image (``ImageError`` with a message a client
  can act on), and names it by a content hash over its decoded pixels (``image_hash``).
* ``ImageCache`` remembers decoded images by a digest of their encoded bytes: agents resend
  every history image on every turn, and none is decoded twice.
"""

from __future__ import annotations

import hashlib
import io
import json
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Qwen2-VL's processors reject images more elongated than this (``smart_resize``).
MAX_ASPECT_RATIO = 200

# Encodings an image part may carry (Pillow format name -> MIME type): what OpenAI's and
# Anthropic's APIs accept.
FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")


class ImageError(ValueError):
    """An image Splice cannot use; the message says why (the API answers 400 with it).

    ``code``: ``image_too_large`` (bytes or pixels over a limit) or ``invalid_image``."""

    def __init__(self, message: str, code: str = "invalid_image"):
        super().__init__(message)
        self.code = code


class VisionNotSupported(ImageError):
    """Images sent to a model without an image processor (a text-only model)."""


@dataclass(frozen=True)
class ImageLimits:
    """What one image may be. ``max_pixels`` bounds the decoded size (decompression bombs)."""

    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 50_000_000
    max_aspect_ratio: float = MAX_ASPECT_RATIO


@dataclass(frozen=True)
class VisionSpec:
    """A Qwen2-VL-family image processor's settings and the vision token ids."""

    image_pad_id: int
    vision_start_id: int
    vision_end_id: int
    banned_ids: tuple[int, ...]  # every vision control id in the vocabulary: never sampled
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    do_resize: bool = True

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """``(height, width)`` after the processor's resize (Qwen2-VL's ``smart_resize``)."""
        if not self.do_resize:
            return height, width
        return smart_resize(height, width, factor=self.factor, min_pixels=self.min_pixels, max_pixels=self.max_pixels)

    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        """``image_grid_thw`` of a ``width`` x ``height`` image (one frame: ``t`` is 1)."""
        h, w = self.resized(height, width)
        return (1, h // self.patch_size, w // self.patch_size)

    def n_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        """``<|image_pad|>`` tokens an image of this grid takes in the prompt."""
        t, h, w = grid_thw
        return t * h * w // (self.merge_size**2)

    @classmethod
    def from_config(cls, cfg: dict[str, Any], token_ids: dict[str, int]) -> "VisionSpec":
        """From a ``preprocessor_config.json`` dict and the tokenizer's ids of ``VISION_TOKENS``.

        Pixel limits as ``Qwen2VLImageProcessor`` reads them: ``min_pixels`` / ``max_pixels``
        when present, else ``size.shortest_edge`` / ``size.longest_edge``.
        """
        size = cfg.get("size") if isinstance(cfg.get("size"), dict) else {}
        min_pixels = cfg.get("min_pixels", size.get("shortest_edge", size.get("min_pixels", 56 * 56)))
        max_pixels = cfg.get("max_pixels", size.get("longest_edge", size.get("max_pixels", 28 * 28 * 1280)))
        missing = [t for t in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>") if t not in token_ids]
        if missing:
            raise ValueError(f"the tokenizer has no {', '.join(missing)} token: it cannot carry images")
        return cls(
            image_pad_id=token_ids["<|image_pad|>"],
            vision_start_id=token_ids["<|vision_start|>"],
            vision_end_id=token_ids["<|vision_end|>"],
            banned_ids=tuple(sorted(token_ids[t] for t in VISION_TOKENS if t in token_ids)),
            patch_size=int(cfg.get("patch_size", 14)),
            merge_size=int(cfg.get("merge_size", 2)),
            temporal_patch_size=int(cfg.get("temporal_patch_size", 2)),
            min_pixels=int(min_pixels),
            max_pixels=int(max_pixels),
            do_resize=bool(cfg.get("do_resize", True)),
        )

    @classmethod
    def from_model_dir(cls, path: str | Path, tokenizer=None) -> "VisionSpec | None":
        """The spec of a model folder; None when it has no Qwen2-VL image processor config.

        Token ids come from ``tokenizer`` when given, else from the folder's tokenizer files.
        """
        cfg_path = Path(path) / "preprocessor_config.json"
        if not cfg_path.is_file():
            return None
        cfg = json.loads(cfg_path.read_text())
        kind = str(cfg.get("image_processor_type") or cfg.get("image_processor_class") or "")
        if not kind.startswith("Qwen2VLImageProcessor"):
            return None
        ids = _vision_token_ids(tokenizer) if tokenizer is not None else _vision_token_ids_from_files(Path(path))
        return cls.from_config(cfg, ids)


def _vision_token_ids(tokenizer) -> dict[str, int]:
    vocab = tokenizer.get_vocab()
    return {t: vocab[t] for t in VISION_TOKENS if t in vocab}


def _vision_token_ids_from_files(folder: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    tj = folder / "tokenizer.json"
    if tj.is_file():
        for tok in json.loads(tj.read_text()).get("added_tokens", []):
            if tok.get("content") in VISION_TOKENS:
                out[tok["content"]] = int(tok["id"])
    tc = folder / "tokenizer_config.json"
    if tc.is_file():
        for tid, tok in (json.loads(tc.read_text()).get("added_tokens_decoder") or {}).items():
            if isinstance(tok, dict) and tok.get("content") in VISION_TOKENS:
                out.setdefault(tok["content"], int(tid))
    return out


def smart_resize(height: int, width: int, *, factor: int = 28, min_pixels: int = 56 * 56, max_pixels: int = 28 * 28 * 1280) -> tuple[int, int]:
    """Qwen2-VL's resize rule: both sides multiples of ``factor``, area within the pixel limits,
    aspect ratio kept as closely as possible (``ImageError`` beyond ``MAX_ASPECT_RATIO``)."""
    import math

    if min(height, width) <= 0:
        raise ImageError(f"image has an empty side ({width}x{height})")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageError(f"image aspect ratio {max(height, width) / min(height, width):.1f} is above {MAX_ASPECT_RATIO}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class ImageInfo:
    """One decoded image as a prompt carries it. ``data``: the encoded bytes as received."""

    hash: str
    mime: str
    width: int
    height: int
    grid_thw: tuple[int, int, int]
    n_tokens: int
    data: bytes = field(repr=False, compare=False)


@dataclass(frozen=True)
class ImageSpan:
    """Where an image sits in a token sequence: ``offset`` of its first ``<|image_pad|>``, ``length`` pads."""

    hash: str
    offset: int
    length: int


def rgb_of(img):
    """The RGB pixels the image processor sees: transparency composited onto white, as
    ``transformers``' ``convert_to_rgb`` does."""
    from PIL import Image

    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


def image_hash(rgb) -> str:
    """Content hash of an image: sha256 over ``"{mode}:{width}x{height}:"`` and its RGB bytes.

    ``rgb``: a Pillow image already in mode RGB (``rgb_of``). The same pixels hash the same
    whatever the encoding (PNG, lossless WebP, ...)."""
    w, h = rgb.size
    return hashlib.sha256(f"{rgb.mode}:{w}x{h}:".encode() + rgb.tobytes()).hexdigest()


def decode_image(data: bytes, spec: VisionSpec, limits: ImageLimits = ImageLimits()) -> ImageInfo:
    """Check and decode one encoded image; ``ImageError`` says what is wrong with it.

    Checked before any pixel is decoded: the byte size, the format, the pixel count from the
    header (a small file can declare a huge image) and the aspect ratio. An animated image
    counts as its first frame, as the image processor reads it.
    """
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise ImageError("image data is empty")
    if len(data) > limits.max_bytes:
        raise ImageError(f"image is {len(data)} bytes, above the limit of {limits.max_bytes} bytes", "image_too_large")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise ImageError("image data is not an image Splice can read (expected PNG, JPEG, WebP or GIF)") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageError(f"image has more than {limits.max_pixels} pixels", "image_too_large") from None
    except Exception as exc:  # noqa: BLE001 - any decoder failure is the image's fault
        raise ImageError(f"image cannot be decoded ({type(exc).__name__})") from None
    fmt = img.format
    if fmt not in FORMATS:
        raise ImageError(f"image format {fmt} is not supported (PNG, JPEG, WebP or GIF)")
    width, height = img.size
    if width <= 0 or height <= 0:
        raise ImageError(f"image has an empty side ({width}x{height})")
    if width * height > limits.max_pixels:
        raise ImageError(f"image is {width}x{height} = {width * height} pixels, above the limit of {limits.max_pixels}", "image_too_large")
    ratio = max(width, height) / min(width, height)
    if ratio > limits.max_aspect_ratio:
        raise ImageError(f"image aspect ratio {ratio:.1f} ({width}x{height}) is above {limits.max_aspect_ratio:g}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img.load()
            rgb = rgb_of(img)
    except Exception as exc:  # noqa: BLE001 - truncated or corrupt pixel data
        raise ImageError(f"image cannot be decoded ({type(exc).__name__}: {exc})"[:200]) from None
    grid = spec.grid(width, height)
    return ImageInfo(
        hash=image_hash(rgb),
        mime=FORMATS[fmt],
        width=width,
        height=height,
        grid_thw=grid,
        n_tokens=spec.n_tokens(grid),
        data=bytes(data),
    )


def check_limits(info: ImageInfo, limits: ImageLimits) -> None:
    """The limits ``decode_image`` checks, for an image decoded earlier (under other limits)."""
    if len(info.data) > limits.max_bytes:
        raise ImageError(f"image is {len(info.data)} bytes, above the limit of {limits.max_bytes} bytes", "image_too_large")
    if info.width * info.height > limits.max_pixels:
        raise ImageError(f"image is {info.width}x{info.height} = {info.width * info.height} pixels, above the limit of {limits.max_pixels}", "image_too_large")
    ratio = max(info.width, info.height) / min(info.width, info.height)
    if ratio > limits.max_aspect_ratio:
        raise ImageError(f"image aspect ratio {ratio:.1f} ({info.width}x{info.height}) is above {limits.max_aspect_ratio:g}")


class ImageCache:
    """Decoded images by a digest of their encoded bytes, least recently used first out.

    Bounded by entry count and by the encoded bytes it holds. ``decodes`` counts real decodes
    (what the cache saved is ``hits``). Thread-safe: decodes may run in worker threads.
    ``decode_slots`` (a semaphore, optional) is held around each real decode only, so a bound
    on concurrent decodes (their peak memory) never delays a cache hit.
    """

    def __init__(self, max_entries: int = 1024, max_bytes: int = 512 * 1024 * 1024, decode_slots=None):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.decode_slots = decode_slots
        self._items: OrderedDict[tuple[bytes, VisionSpec], ImageInfo] = OrderedDict()
        self._aliases: OrderedDict[tuple[bytes, VisionSpec], tuple[bytes, VisionSpec]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.decodes = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._items)

    def decode(self, data: bytes, spec: VisionSpec, limits: ImageLimits = ImageLimits()) -> ImageInfo:
        """``decode_image(data, spec, limits)``, decoding each distinct encoding once."""
        return self._decode(data, spec, limits)

    def decode_text(self, text: str, to_bytes, spec: VisionSpec, limits: ImageLimits = ImageLimits()) -> ImageInfo:
        """The same for an image carried as text (base64; ``to_bytes`` decodes it): also keyed by
        a digest of the text, so an image resent as the same text is not even base64-decoded again
        (base64 decoding costs several times the digest)."""
        alias = (hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=20).digest(), spec)
        with self._lock:
            key = self._aliases.get(alias)
            info = self._items.get(key) if key is not None else None
            if info is not None:
                self._items.move_to_end(key)
                self._aliases.move_to_end(alias)
                self.hits += 1
        if info is not None:
            check_limits(info, limits)
            return info
        return self._decode(to_bytes(text), spec, limits, alias=alias)

    def _decode(self, data: bytes, spec: VisionSpec, limits: ImageLimits, alias=None) -> ImageInfo:
        if len(data) > limits.max_bytes:
            raise ImageError(f"image is {len(data)} bytes, above the limit of {limits.max_bytes} bytes", "image_too_large")
        key = (hashlib.blake2b(data, digest_size=20).digest(), spec)
        with self._lock:
            info = self._items.get(key)
            if info is not None:
                self._items.move_to_end(key)
                self.hits += 1
                if alias is not None:
                    self._remember_alias(alias, key)
        if info is not None:
            check_limits(info, limits)
            return info
        if self.decode_slots is None:
            info = decode_image(data, spec, limits)
        else:
            with self.decode_slots:
                info = decode_image(data, spec, limits)
        with self._lock:
            self.decodes += 1
            if key not in self._items:
                self._items[key] = info
                self._bytes += len(info.data)
            if alias is not None:
                self._remember_alias(alias, key)
            while self._items and (len(self._items) > self.max_entries or self._bytes > self.max_bytes):
                _, old = self._items.popitem(last=False)
                self._bytes -= len(old.data)
        return info

    def _remember_alias(self, alias, key) -> None:
        self._aliases[alias] = key
        self._aliases.move_to_end(alias)
        while len(self._aliases) > 2 * self.max_entries:  # stale ones (evicted images) go first
            self._aliases.popitem(last=False)


def find_image_spans(ids: list[int], spec: VisionSpec, base: int = 0) -> list[tuple[int, int]]:
    """``(offset, length)`` of each run of ``<|image_pad|>`` in ``ids``; offsets plus ``base``.

    Only the chat template writes that token (text spelling it stays text, sampling bans it),
    so each run is one image."""
    pad = spec.image_pad_id
    out: list[tuple[int, int]] = []
    i, n = 0, len(ids)
    while i < n:
        if ids[i] == pad:
            j = i
            while j < n and ids[j] == pad:
                j += 1
            out.append((base + i, j - i))
            i = j
        else:
            i += 1
    return out


def expand_image_pads(ids: list[int], images, image_pad_id: int) -> list[int]:
    """``ids`` with the k-th ``<|image_pad|>`` repeated ``images[k].n_tokens`` times.

    The template writes one pad per image; ``ImageError`` if the counts differ."""
    count = sum(1 for t in ids if t == image_pad_id)
    if count != len(images):
        raise ImageError(f"the chat template wrote {count} image placeholders for {len(images)} images")
    if not images:
        return list(ids)
    out: list[int] = []
    k = 0
    for t in ids:
        if t == image_pad_id:
            out.extend([image_pad_id] * images[k].n_tokens)
            k += 1
        else:
            out.append(t)
    return out


def image_spans(ids: list[int], images, spec: VisionSpec, base: int = 0) -> list[ImageSpan]:
    """The ``ImageSpan`` of each of ``images`` (prompt order) in expanded ``ids``; ``ImageError``
    when the runs do not match the images one for one."""
    runs = find_image_spans(ids, spec, base)
    if len(runs) != len(images):
        raise ImageError(f"{len(runs)} image placeholder runs for {len(images)} images")
    out = []
    for (off, n), img in zip(runs, images):
        if n != img.n_tokens:
            raise ImageError(f"image {img.hash[:12]} spans {n} placeholders, expected {img.n_tokens}")
        out.append(ImageSpan(img.hash, off, n))
    return out
