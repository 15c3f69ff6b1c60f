"""The policy: a transformers causal LM whose forward returns per-token log-probs, not logits.

``Policy.forward`` runs the decoder body to get final hidden states, then applies the LM head in
chunks (``logprobs.py``), so a full ``[tokens, vocab]`` logits tensor never exists. Being an
``nn.Module`` whose forward does the whole computation, it is the FSDP2 root (``sharding.py``):
the head's weight is read inside this forward, where FSDP has all-gathered it, never from outside.

Dropout is always off: it would make the proximal pass and the first training pass differ, and
the PPO ratio on the first minibatch must be exactly 1. The model runs in eval mode (gradients
work regardless) unless gradient checkpointing is on, which transformers only applies in train
mode; then it runs in train mode with every dropout rate set to 0.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import shutil
from pathlib import Path

import torch
from torch import nn

from . import attention
from .logprobs import token_logprobs_and_entropy
from .vision import VISION_MODEL_TYPES, VisionSettings, dummy_pixels, packed_rope_positions

# Tokenizer files the engines need next to the weights.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    # a vision model's processor settings: the engines expand images with them
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
)


class Policy(nn.Module):
    """``vision``: the settings of a Qwen2.5-VL model (``VisionSettings.from_model_dir``); then the
    forward takes ``pixel_values``/``image_grid_thw``, computes M-RoPE positions per packed sample
    and leaves the vision control ids out of the log-softmax (they are banned at sampling)."""

    def __init__(self, model: nn.Module, *, temperature: float = 1.0, chunk_size: int = 1024,
                 vision: VisionSettings | None = None):
        super().__init__()
        self.model = model
        self.temperature = temperature
        self.chunk_size = chunk_size
        self.vision = vision
        cfg = getattr(model, "config", None)
        for attr in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
            value = getattr(cfg, attr, None)
            if value not in (None, 1, 1.0):
                raise NotImplementedError(f"models with config.{attr}={value} are not supported yet")
        self.train()

    @property
    def body(self) -> nn.Module:
        return self.model.base_model

    @property
    def head(self) -> nn.Linear:
        return self.model.get_output_embeddings()

    def train(self, mode: bool = True) -> "Policy":
        """Train mode only where it is needed (gradient checkpointing), never with dropout."""
        checkpointing = any(getattr(m, "gradient_checkpointing", False) is True for m in self.model.modules())
        super().train(mode and checkpointing)
        if mode and checkpointing:
            disable_dropout(self.model)
        return self

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        rope_position_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logprobs, entropy)`` in token coordinates, float32, shaped like ``input_ids``.

        Packed input (several samples in one row): ``attention_mask`` None and ``position_ids``
        restarting at 0 per sample; a token at position 0 has nothing predicting it and gets 0.
        With ``loss_mask`` only those tokens go through the LM head (the rest are 0); if it
        selects nothing, one token still goes through, so that every parameter takes part in
        backward (a rank with nothing to learn still joins FSDP's gradient reduce).
        A vision policy takes the micro-batch's images (token order) as ``pixel_values`` and
        ``image_grid_thw``; without images its vision tower still runs on a dummy input, times 0,
        for the same reason. ``rope_position_ids`` (``[4, rows, T]``, ``vision.packed_rope_positions``)
        saves recomputing the M-RoPE positions in every pass.
        """
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(input_ids)
        head = self.head
        # fp32 weights on CUDA (no FSDP mixed precision): compute the body under bf16 autocast
        autocast = (
            torch.autocast("cuda", dtype=torch.bfloat16)
            if input_ids.device.type == "cuda" and head.weight.dtype == torch.float32
            else contextlib.nullcontext()
        )
        banned = None
        with autocast:
            if self.vision is None:
                extra = {}
                impl = getattr(getattr(self.model, "config", None), "_attn_implementation", None)
                if impl in attention.PACKED:  # sample boundaries, once per forward
                    if attention_mask is not None:  # right padding only: causal attention never reaches it
                        m = attention_mask.bool()
                        if bool((m[..., 1:] & ~m[..., :-1]).any()):
                            raise ValueError(f"{impl} needs packed or right-padded rows, not left or inner padding")
                        attention_mask = None
                    extra[attention.LAYOUT_KWARG] = attention.packed_layout(position_ids, impl)
                hidden = self.body(
                    input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                    **extra,
                ).last_hidden_state
            else:
                hidden = self._vision_body(input_ids, attention_mask, position_ids, pixel_values, image_grid_thw,
                                           rope_position_ids)
                banned = torch.tensor(self.vision.banned_ids, dtype=torch.long, device=input_ids.device)
        starts = position_ids == 0
        mask = None
        if loss_mask is not None:
            mask = loss_mask.bool() & ~starts
            if input_ids.shape[-1] > 1 and not bool(mask.any()):
                mask = mask.clone()
                mask[..., -1] = True  # zero-weight: in the graph, not in the loss (loss_mask is 0)
        with torch.autocast(input_ids.device.type, enabled=False):  # log-probs always in float32
            lp, ent = token_logprobs_and_entropy(
                hidden,
                input_ids,
                head.weight,
                head.bias,
                temperature=self.temperature,
                chunk_size=self.chunk_size,
                mask=mask,
                banned_ids=banned,
            )
        zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
        if banned is not None and loss_mask is not None:  # a banned id outside the loss: -inf, never used
            starts = starts | (~loss_mask.bool() & torch.isinf(lp))
        return torch.where(starts, zero, lp), torch.where(starts, zero, ent)

    def _vision_body(self, input_ids, attention_mask, position_ids, pixel_values, image_grid_thw,
                     positions=None) -> torch.Tensor:
        """Final hidden states of a Qwen2.5-VL body: images on their pad tokens, M-RoPE per sample."""
        if attention_mask is not None:
            raise NotImplementedError("a vision policy runs packed micro-batches (attention_mask None)")
        body = self.body
        if positions is None:
            positions = packed_rope_positions(body.get_rope_index, input_ids, position_ids, image_grid_thw,
                                              self.vision.image_token_id)
        dummy = None
        if pixel_values is None:
            pixel_values, image_grid_thw = (t.to(input_ids.device) for t in dummy_pixels(self.vision))
            dummy = body.get_image_features(pixel_values, image_grid_thw, return_dict=True).pooler_output
            pixel_values = image_grid_thw = None
        hidden = body(input_ids=input_ids, position_ids=positions, pixel_values=pixel_values,
                      image_grid_thw=image_grid_thw, use_cache=False).last_hidden_state
        if dummy is not None:  # in the graph (FSDP runs the vision blocks' collectives), adds 0
            hidden = hidden + 0.0 * sum(d.sum() for d in dummy).to(hidden.dtype)
        return hidden


def disable_dropout(model: nn.Module) -> None:
    """Zero every dropout rate: ``nn.Dropout`` modules and the float rates HF attention modules keep."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        for attr in ("attention_dropout", "dropout"):
            if isinstance(getattr(module, attr, None), float):
                setattr(module, attr, 0.0)


def pick_attn_implementation(preference: str, device: torch.device) -> str | None:
    """``auto``: flash-attention 2 (varlen) on CUDA when installed, else FlexAttention with a
    document block mask on CUDA, else one SDPA per sample (``attention.pick``)."""
    return attention.pick(preference, device)


def load_causal_lm(
    model_dir: str,
    *,
    dtype: str = "float32",
    gradient_checkpointing: bool = False,
    attn_implementation: str | None = None,
) -> nn.Module:
    """Load a local HF causal LM directory (no hub access); a Qwen2.5-VL folder (``model_type``
    ``qwen2_5_vl``) as its ``Qwen2_5_VLForConditionalGeneration``."""
    from transformers import AutoModelForCausalLM

    auto = AutoModelForCausalLM
    if _model_type(model_dir) in VISION_MODEL_TYPES:
        from transformers import AutoModelForImageTextToText as auto  # Qwen2_5_VLForConditionalGeneration

    torch_dtype = getattr(torch, dtype)
    attn_implementation = packed_attention_for(model_dir, attn_implementation)
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    try:
        model = auto.from_pretrained(model_dir, dtype=torch_dtype, local_files_only=True, **extra)
    except TypeError:  # transformers < 4.56 spells it torch_dtype
        model = auto.from_pretrained(model_dir, torch_dtype=torch_dtype, local_files_only=True, **extra)
    return prepare_for_training(model, gradient_checkpointing)


def prepare_for_training(model: nn.Module, gradient_checkpointing: bool = False) -> nn.Module:
    """No KV cache; activation checkpointing per decoder layer (non-reentrant) when asked."""
    if gradient_checkpointing:
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 name
            model.activation_checkpointing_enable(kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False
    text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else None
    if text_config is not None:
        text_config.use_cache = False
    return model


def packed_attention_for(model_dir: str, attn_implementation: str | None) -> str | None:
    """The implementation a model folder runs: the packed ones are registered with transformers
    first; a vision model keeps sdpa (its M-RoPE positions and vision tower take the mask path)."""
    if attn_implementation in attention.PACKED:
        if _model_type(model_dir) in VISION_MODEL_TYPES:
            return "sdpa"
        attention.register()
    return attn_implementation


def _model_type(model_dir: str) -> str | None:
    try:
        return json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None


def checkpoint_dtype(model_dir: str | None) -> str | None:
    """The dtype a model directory's weights are stored in (``config.json``'s ``torch_dtype`` or
    ``dtype``): what an engine serving that directory runs in, so what a publish should send."""
    if not model_dir:
        return None
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    name = cfg.get("torch_dtype") or cfg.get("dtype")
    return name if isinstance(name, str) and isinstance(getattr(torch, name, None), torch.dtype) else None


def save_hf_dir(
    model: nn.Module,
    src_dir: str | None,
    out_dir: str | Path,
    *,
    dtype: str | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write ``model`` (or ``state_dict``, e.g. gathered from FSDP shards) as a safetensors HF
    directory plus the tokenizer files from ``src_dir``.

    Written to a temporary sibling and renamed, so an engine never loads a half-written directory.
    """
    out = Path(out_dir).absolute()
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if dtype is not None:
        target = getattr(torch, dtype)
        source = state_dict if state_dict is not None else model.state_dict()
        state_dict = {k: (v.to(target) if v.is_floating_point() else v) for k, v in source.items()}
    kwargs = {"state_dict": state_dict} if state_dict is not None else {}
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        kwargs["safe_serialization"] = True  # transformers 4.x; 5.x always writes safetensors
    model.save_pretrained(tmp, **kwargs)
    if src_dir is not None:
        for name in TOKENIZER_FILES:
            src = Path(src_dir) / name
            if src.is_file() and not (tmp / name).exists():
                shutil.copy2(src, tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
