"""Images for a vision-language model: decode, process once per content hash, expand placeholders.

The reference engine takes images the way the released servers do: each image of a prompt is
ONE ``<|image_pad|>`` between ``<|vision_start|>`` and ``<|vision_end|>`` plus the image itself
(a ``data:`` URL), in prompt order. The engine runs the model folder's image processor
(``Qwen2VLImageProcessorPil`` from ``preprocessor_config.json``) and expands each single pad to
``grid_t * grid_h * grid_w / merge_size**2`` pads, as SGLang's ``build_input_ids`` and vLLM's
prompt updates do; every token coordinate the engine reports is in that expanded prompt.

Decoding and processing an image costs far more than a forward pass of the tiny model, so each
image is processed once: results are cached by the digest of the bytes received and by the
content hash of the decoded pixels.
"""

from __future__ import annotations

import base64
import binascii
import collections
import hashlib
import io
import json
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from .vision_files import IMAGE_PAD_ID, VIDEO_PAD_ID, VISION_END_ID, VISION_START_ID

CACHE_SIZE = 256  # processed images kept (tiny-model images are a few hundred KB of floats each)
MAX_IMAGE_BYTES = 20 * 1024 * 1024


class ImageInputError(ValueError):
    """An image or its placeholder the engine rejects (HTTP 400)."""


@dataclass(frozen=True)
class ProcessedImage:
    """One image as the model consumes it."""

    hash: str  # sha256 over f"{mode}:{w}x{h}:" + RGB bytes of the decoded image (mode after RGB conversion)
    width: int
    height: int
    grid_thw: tuple[int, int, int]
    n_tokens: int  # placeholder tokens the image occupies in the expanded prompt
    pixel_values: torch.Tensor  # [grid_t * grid_h * grid_w, channels * temporal * patch * patch], float32


@dataclass(frozen=True)
class ImageSpan:
    """Where an image sits in the expanded prompt: ``length`` pads from ``offset``."""

    offset: int
    length: int
    image: ProcessedImage


@dataclass(frozen=True)
class VisionConfig:
    """What the engine needs from a Qwen2-VL-family model folder."""

    image_pad_id: int
    video_pad_id: int
    vision_start_id: int
    vision_end_id: int
    merge_size: int
    processor_kwargs: dict

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, config) -> "VisionConfig":
        path = Path(model_dir) / "preprocessor_config.json"
        if not path.is_file():
            raise ValueError(f"{model_dir}: a vision-language model folder needs preprocessor_config.json")
        raw = json.loads(path.read_text())
        kwargs = {k: v for k, v in raw.items() if k not in ("image_processor_type", "processor_class")}
        return cls(
            image_pad_id=int(getattr(config, "image_token_id", IMAGE_PAD_ID)),
            video_pad_id=int(getattr(config, "video_token_id", VIDEO_PAD_ID)),
            vision_start_id=int(getattr(config, "vision_start_token_id", VISION_START_ID)),
            vision_end_id=int(getattr(config, "vision_end_token_id", VISION_END_ID)),
            merge_size=int(raw.get("merge_size", 2)),
            processor_kwargs=kwargs,
        )


def image_hash(img) -> str:
    """Content hash of a decoded PIL image (same pixels, same hash, whatever the encoding)."""
    rgb = img.convert("RGB")
    h = hashlib.sha256(f"{rgb.mode}:{rgb.width}x{rgb.height}:".encode())
    h.update(rgb.tobytes())
    return h.hexdigest()


def decode_data_url(url) -> bytes:
    """The bytes of a ``data:image/...;base64,`` URL (or bare base64, as SGLang also accepts)."""
    if not isinstance(url, str) or not url:
        raise ImageInputError("each image must be a base64 data URL string (data:image/png;base64,...)")
    if url.startswith("data:"):
        head, sep, payload = url.partition(",")
        if not sep or ";base64" not in head:
            raise ImageInputError("image data URLs must be base64-encoded (data:image/png;base64,...)")
    elif "://" in url[:16] or url.startswith(("/", "file:")):
        raise ImageInputError("the reference engine takes images as base64 data URLs only, not remote URLs or paths")
    else:
        payload = url
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageInputError("image data is not valid base64") from None
    if not data:
        raise ImageInputError("image data is empty")
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageInputError(f"image is {len(data)} bytes; the limit is {MAX_IMAGE_BYTES}")
    return data


class ImageProcessor:
    """Decodes and processes images with the model folder's settings; thread-safe, cached."""

    def __init__(self, vcfg: VisionConfig):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.vcfg = vcfg
        self._proc = Qwen2VLImageProcessorPil(**vcfg.processor_kwargs)
        self._by_bytes: collections.OrderedDict[str, ProcessedImage] = collections.OrderedDict()
        self._by_hash: collections.OrderedDict[str, ProcessedImage] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.processed = 0  # images run through the processor since start (a debug counter)

    def prefetch(self, urls) -> None:
        """Process what can be processed now (errors are raised later, where the request is parsed)."""
        for url in [urls] if isinstance(urls, str) else urls if isinstance(urls, list) else []:
            try:
                self.process(url)
            except ImageInputError:
                pass

    def process(self, url: str) -> ProcessedImage:
        """The processed image for a data URL (cached by bytes digest, then by content hash)."""
        data = decode_data_url(url)
        digest = hashlib.sha256(data).hexdigest()
        with self._lock:
            hit = self._by_bytes.get(digest)
            if hit is not None:
                self._by_bytes.move_to_end(digest)
                return hit
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(io.BytesIO(data)) as im:
                im.load()
                rgb = im.convert("RGB")
        except (UnidentifiedImageError, OSError, ValueError) as e:
            raise ImageInputError(f"cannot decode image: {e}") from None
        h = image_hash(rgb)
        with self._lock:
            hit = self._by_hash.get(h)
        if hit is None:
            out = self._proc(images=[rgb], return_tensors="pt")
            grid = tuple(int(x) for x in out["image_grid_thw"][0].tolist())
            n = grid[0] * grid[1] * grid[2] // self.vcfg.merge_size**2
            hit = ProcessedImage(h, rgb.width, rgb.height, grid, n, out["pixel_values"].to(torch.float32))
            with self._lock:
                self.processed += 1
                self._by_hash[h] = hit
                while len(self._by_hash) > CACHE_SIZE:
                    self._by_hash.popitem(last=False)
        with self._lock:
            self._by_bytes[digest] = hit
            while len(self._by_bytes) > CACHE_SIZE:
                self._by_bytes.popitem(last=False)
        return hit


def check_no_video(ids: list[int], vcfg: VisionConfig) -> None:
    if vcfg.video_pad_id in ids:
        raise ImageInputError("video inputs (<|video_pad|>) are not supported by the reference engine")


def expand_single_pads(ids: list[int], images: list[ProcessedImage], vcfg: VisionConfig, *, server: str) -> tuple[list[int], list[ImageSpan]]:
    """Expand each image's single ``<|image_pad|>`` to its processor count, in prompt order.

    Raises ImageInputError (the request's 400) when the prompt does not hold exactly one pad
    per image, each between ``<|vision_start|>`` and ``<|vision_end|>``: a pre-expanded span
    (consecutive pads) is named as such, since the released servers expand every pad again
    (SGLang's ``build_input_ids`` treats each pad as an image start and fails; vLLM 0.32's
    prompt update replaces the first pads of the span, silently corrupting the prompt).
    """
    pad = vcfg.image_pad_id
    check_no_video(ids, vcfg)
    positions = [i for i, t in enumerate(ids) if t == pad]
    if any(b == a + 1 for a, b in zip(positions, positions[1:])):
        raise ImageInputError(
            f"the prompt holds pre-expanded image placeholder spans ({len(positions)} <|image_pad|> tokens for "
            f"{len(images)} image(s)); {server} expands every <|image_pad|> itself, so send each image as ONE "
            "<|image_pad|> between <|vision_start|> and <|vision_end|>"
        )
    if len(positions) != len(images):
        raise ImageInputError(
            f"the prompt has {len(positions)} image placeholder(s) (<|image_pad|>) but {len(images)} image(s) were sent; "
            "send one image per placeholder, in prompt order"
        )
    out: list[int] = []
    spans: list[ImageSpan] = []
    prev = 0
    for p, img in zip(positions, images):
        if p == 0 or ids[p - 1] != vcfg.vision_start_id or p + 1 >= len(ids) or ids[p + 1] != vcfg.vision_end_id:
            raise ImageInputError(f"the image placeholder at position {p} is not between <|vision_start|> and <|vision_end|>")
        out.extend(ids[prev:p])
        spans.append(ImageSpan(len(out), img.n_tokens, img))
        out.extend([pad] * img.n_tokens)
        prev = p + 1
    out.extend(ids[prev:])
    return out, spans


def check_no_images(ids: list[int], vcfg: VisionConfig | None) -> None:
    """A prompt without images must not hold image placeholders (the model would fail on them)."""
    if vcfg is None:
        return
    check_no_video(ids, vcfg)
    if vcfg.image_pad_id in ids:
        raise ImageInputError(
            "the prompt holds <|image_pad|> tokens but no images were sent; send the images "
            "(one per placeholder, in prompt order) with the request"
        )
