"""Shared helpers for the vision reference-engine tests: images, an independent oracle, HTTP."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import httpx
import numpy as np
import torch

from engines.reference.vision_files import IMAGE_PAD_ID

TOL = 1e-4

def png(width: int, height: int, seed: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


def pil(raw: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(raw)).convert("RGB")


class VisionOracle:
    """Full forward passes of the HF model with the processor's pixels (float64)."""

    def __init__(self, model_dir):
        from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).double().eval()
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        cfg = json.loads((Path(model_dir) / "preprocessor_config.json").read_text())
        self.cfg = {k: v for k, v in cfg.items() if k not in ("image_processor_type", "processor_class")}
        self.image_processor = Qwen2VLImageProcessorPil(**self.cfg)

    def processor(self):
        """The real ``Qwen2_5_VLProcessor`` (built without ``__init__``: torchvision is absent)."""
        from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor

        p = Qwen2_5_VLProcessor.__new__(Qwen2_5_VLProcessor)
        p.image_processor = self.image_processor
        p.tokenizer = self.tokenizer
        p.video_processor = None
        p.chat_template = self.tokenizer.chat_template
        p.image_token, p.video_token = "<|image_pad|>", "<|video_pad|>"
        p.image_token_id, p.video_token_id = IMAGE_PAD_ID, 151656
        return p

    def chat_text(self, content: list[dict]) -> str:
        return self.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)

    def collapsed_ids(self, text: str) -> list[int]:
        """The prompt with ONE pad per image (what the wire carries)."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def expanded(self, text: str, images: list[bytes]) -> tuple[list[int], list[tuple[int, int, int]]]:
        """The processor's own expansion: (input_ids, grids)."""
        out = self.processor()(text=[text], images=[pil(b) for b in images], return_tensors="np")
        return [int(x) for x in out["input_ids"][0]], [tuple(int(v) for v in g) for g in out["image_grid_thw"]]

    @torch.inference_mode()
    def logits(self, ids: list[int], images: list[bytes]) -> torch.Tensor:
        ids_t = torch.tensor([ids])
        kw = {}
        if images:
            px = self.image_processor(images=[pil(b) for b in images], return_tensors="pt")
            kw = {
                "pixel_values": px["pixel_values"].double(),
                "image_grid_thw": px["image_grid_thw"],
                "mm_token_type_ids": (ids_t == IMAGE_PAD_ID).int(),
            }
        return self.model(input_ids=ids_t, **kw).logits[0]

    def logprobs(self, ids: list[int], images: list[bytes], bias: dict[int, float] | None = None) -> list[float | None]:
        """Entry i = log p(ids[i] | ids[:i]) (optionally with ``bias`` added to the logits); entry 0 None."""
        logits = self.logits(ids, images)
        if bias:
            logits = logits.clone()
            for t, b in bias.items():
                logits[:, t] += b
        lsm = torch.log_softmax(logits, dim=-1)
        return [None] + [float(lsm[i - 1, ids[i]]) for i in range(1, len(ids))]


def post(url: str, path: str, body: dict, status: int = 200) -> dict:
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def assert_close(got, want, what, tol=TOL):
    """Equal up to float32 rounding of the engine (relative for the random model's large logits)."""
    assert len(got) == len(want), f"{what}: {len(got)} vs {len(want)} entries"
    for i, (g, w) in enumerate(zip(got, want)):
        if w is None:
            assert g is None, f"{what}[{i}] should be null"
        else:
            assert g is not None and abs(g - w) < tol + 2e-5 * abs(w), f"{what}[{i}]: {g} vs {w}"
