"""Real images and expanded Qwen2.5-VL prompts for the engine image tests.

Each image is a real PNG; its pad count comes from the Qwen2-VL image processor itself
(``Qwen2VLImageProcessorPil`` with the tiny vision model's ``preprocessor_config.json``
settings), never from Splice's code.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import io

from PIL import Image

from engines.types import EngineImage

VISION_START_ID, VISION_END_ID, IMAGE_PAD_ID = 151652, 151653, 151655
# engines/reference/vision_files.py write_vision_processor_files(): Qwen2VLImageProcessor
PREPROCESSOR = {
    "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
    "rescale_factor": 1 / 255, "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711], "patch_size": 14, "merge_size": 2,
    "temporal_patch_size": 2, "min_pixels": 4 * 28 * 28, "max_pixels": 256 * 28 * 28,
    "size": {"shortest_edge": 4 * 28 * 28, "longest_edge": 256 * 28 * 28},
}

# <|im_start|>user\n ... <|im_end|>\n<|im_start|>assistant\n
HEAD = [151644, 872, 198]
TAIL = [151645, 198, 151644, 77091, 198]
BANNED = (151652, 151653, 151654, 151655, 151656)


@functools.lru_cache(maxsize=1)
def processor():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**PREPROCESSOR)


def png(size: tuple[int, int], color: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def grid(data: bytes) -> tuple[int, int, int]:
    with Image.open(io.BytesIO(data)) as im:
        out = processor()(images=[im.convert("RGB")], return_tensors="np")
    t, h, w = (int(x) for x in out["image_grid_thw"][0])
    return t, h, w


def url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def prompt(*parts) -> tuple[list[int], list[EngineImage]]:
    """An expanded prompt: ``parts`` are lists of text ids or PNG bytes (one image each)."""
    ids: list[int] = []
    images: list[EngineImage] = []
    for part in parts:
        if isinstance(part, bytes):
            g = grid(part)
            n = g[0] * g[1] * g[2] // 4
            ids.append(VISION_START_ID)
            with Image.open(io.BytesIO(part)) as im:
                rgb = im.convert("RGB")
                digest = hashlib.sha256(f"RGB:{rgb.width}x{rgb.height}:".encode() + rgb.tobytes()).hexdigest()
            images.append(EngineImage(hash=digest, data=part, mime="image/png", offset=len(ids), length=n, grid_thw=g))
            ids.extend([IMAGE_PAD_ID] * n)
            ids.append(VISION_END_ID)
        else:
            ids.extend(part)
    return ids, images


def collapsed(ids: list[int]) -> list[int]:
    """Every run of pads reduced to one (written out here, independently of engines.images)."""
    out: list[int] = []
    for t in ids:
        if t == IMAGE_PAD_ID and out and out[-1] == IMAGE_PAD_ID:
            continue
        out.append(t)
    return out


RED = png((150, 100), (200, 30, 30))  # grid (1, 8, 10): 20 pads
BLUE = png((60, 60), (30, 30, 200))  # grid (1, 4, 4): 4 pads
GREEN = png((300, 200), (30, 200, 30))  # grid (1, 14, 22): 77 pads
