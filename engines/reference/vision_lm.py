"""A Qwen2-VL-family model behind the reference engine: prefill with images, decode with M-RoPE.

The prompt's input embeddings are the token embeddings with each image's vision-encoder
features written over its ``<|image_pad|>`` span (what the model's own forward does). Positions
are the model's own 3-D M-RoPE positions (``get_rope_index``, given the image token types and
grids). Each request keeps its KV cache and its ``rope_delta`` (the last M-RoPE position + 1
minus the prompt length), so a decoded token at sequence index ``i`` sits at position
``i + rope_delta`` on all three axes, as in the model's ``generate``; the model-level
``rope_deltas`` attribute transformers keeps is never used, since requests interleave here.

Cost: the vision encoder runs once per request prefill (its output depends on the weights, so
it is not cached across requests); image decoding and processing are cached (``vision.py``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from .lm import PREFILL_CHUNK, LanguageModel
from .vision import ImageInputError, ImageSpan, VisionConfig

# Checkpoint names (as the released checkpoints and ``save_pretrained`` write them) -> module names.
_RENAMES = (
    (re.compile(r"^visual\."), "model.visual."),
    (re.compile(r"^model\.(?!language_model\.|visual\.)"), "model.language_model."),
)


@dataclass
class VisionCache:
    """One request's decoding state: the KV cache and its M-RoPE offset."""

    kv: object
    rope_delta: int = 0


class VisionLanguageModel(LanguageModel):
    """``LanguageModel`` for a ``Qwen2_5_VLForConditionalGeneration`` (or Qwen2-VL) folder."""

    def __init__(self, model_dir: str | os.PathLike):
        super().__init__(model_dir)
        self.vision = VisionConfig.from_model_dir(model_dir, self.config)
        self._vl = self.model.model  # Qwen2_5_VLModel: visual encoder + language model
        self._text = self._vl.language_model

    @staticmethod
    def _load(model_dir: str):
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)

    def module_name(self, name: str) -> str:
        for pattern, repl in _RENAMES:
            if pattern.search(name):
                return pattern.sub(repl, name, count=1)
        return name

    def new_cache(self) -> VisionCache:
        from transformers import DynamicCache

        return VisionCache(DynamicCache(config=self.config.get_text_config()))

    def _check_spans(self, ids: list[int], images: list[ImageSpan]) -> None:
        """Every run of image pads in ``ids`` is exactly one image's span of its processor count."""
        pad = self.vision.image_pad_id
        runs: list[tuple[int, int]] = []
        i = 0
        while i < len(ids):
            if ids[i] == pad:
                j = i
                while j < len(ids) and ids[j] == pad:
                    j += 1
                runs.append((i, j - i))
                i = j
            else:
                i += 1
        want = [(s.offset, s.length) for s in images]
        if runs != want or any(s.length != s.image.n_tokens for s in images):
            raise ImageInputError(
                f"image placeholder spans {runs} do not match the images' processor counts "
                f"{[(s.offset, s.image.n_tokens) for s in images]}"
            )

    @torch.inference_mode()
    def prefill(self, ids: list[int], cache: VisionCache, *, keep_from: int, images=()) -> torch.Tensor:
        images = list(images)
        self._check_spans(ids, images)
        ids_t = torch.tensor([ids])
        embeds = self._vl.get_input_embeddings()(ids_t)
        if images:
            pixels = torch.cat([s.image.pixel_values for s in images], dim=0)
            grid = torch.tensor([list(s.image.grid_thw) for s in images], dtype=torch.long)
            feats = torch.cat(self._vl.get_image_features(pixels, grid, return_dict=True).pooler_output, dim=0)
            mask = ids_t == self.vision.image_pad_id
            embeds = embeds.masked_scatter(mask.unsqueeze(-1).expand_as(embeds), feats.to(embeds.dtype))
            positions, delta = self._vl.get_rope_index(ids_t, mm_token_type_ids=mask.int(), image_grid_thw=grid)
            cache.rope_delta = int(delta.reshape(-1)[0])
        else:
            positions = torch.arange(len(ids)).view(1, 1, -1).expand(3, 1, -1)
            cache.rope_delta = 0
        kept = []
        for start in range(0, len(ids), PREFILL_CHUNK):
            end = min(start + PREFILL_CHUNK, len(ids))
            out = self._text(
                inputs_embeds=embeds[:, start:end],
                position_ids=positions[:, :, start:end],
                cache=cache.kv,
                use_cache=True,
            )
            if end > keep_from:
                kept.append(out.last_hidden_state[0, max(keep_from - start, 0) :])
        return torch.cat(kept, dim=0)

    @torch.inference_mode()
    def step(self, token: int, cache: VisionCache) -> torch.Tensor:
        pos = cache.kv.get_seq_length() + cache.rope_delta
        out = self._text(
            input_ids=torch.tensor([[token]]),
            position_ids=torch.full((3, 1, 1), pos, dtype=torch.long),
            cache=cache.kv,
            use_cache=True,
        )
        return self._head(out.last_hidden_state[0, -1]).float()
