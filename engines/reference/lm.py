"""The causal LM behind the reference engine: load, prefill, decode one token, swap weights.

Only the worker thread calls into this (torch work never runs on the event loop). Logits are
computed from the final hidden states in small chunks, so scoring a long prompt never
materialises a ``[L, vocab]`` matrix.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

PREFILL_CHUNK = 512  # prompt tokens per forward pass (bounds attention memory)
LOGITS_CHUNK = 64  # positions per lm_head call (64 x 151936 floats = 39 MB)


def _quiet_transformers() -> None:
    import warnings

    import transformers

    # transformers 5.x renames the forward's cache argument; older releases know only this name
    warnings.filterwarnings("ignore", message=".*past_key_values.* is deprecated", category=FutureWarning)

    transformers.logging.set_verbosity_error()
    try:
        transformers.utils.logging.disable_progress_bar()
    except AttributeError:  # pragma: no cover - older transformers
        pass


@functools.lru_cache(maxsize=8)
def _tokenizer_cached(model_dir: str, stamp: float):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def load_tokenizer(model_dir: str | os.PathLike):
    """The tokenizer of ``model_dir``, parsed once per process (parsing the 11 MB Qwen3 file takes seconds).

    Shared instances are only used for encode/decode, which are safe across threads.
    """
    path = os.path.realpath(model_dir)
    tj = os.path.join(path, "tokenizer.json")
    return _tokenizer_cached(path, os.path.getmtime(tj) if os.path.exists(tj) else 0.0)


def is_vision_model_dir(model_dir: str | os.PathLike) -> bool:
    """Whether ``model_dir`` holds a Qwen2-VL-family vision-language model (by its config)."""
    import json

    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return False
    cfg = json.loads(path.read_text())
    archs = cfg.get("architectures") or []
    return cfg.get("model_type") in VISION_MODEL_TYPES or any(a in VISION_ARCHITECTURES for a in archs)


VISION_MODEL_TYPES = ("qwen2_5_vl", "qwen2_vl")
VISION_ARCHITECTURES = ("Qwen2_5_VLForConditionalGeneration", "Qwen2VLForConditionalGeneration")


class LanguageModel:
    """A float32 transformers causal LM plus its tokenizer and stop (EOS) token ids."""

    vision = None  # a VisionConfig on vision-language models (``vision_lm.VisionLanguageModel``)

    def __init__(self, model_dir: str | os.PathLike):
        _quiet_transformers()
        self.model_dir = str(model_dir)
        self.model = self._load(self.model_dir).eval()
        self.model.requires_grad_(False)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.config = self.model.config
        text_cfg = self.config.get_text_config()
        self.vocab_size = int(text_cfg.vocab_size)
        self.context_len = int(getattr(text_cfg, "max_position_embeddings", 0) or 32768)
        self.eos_ids = self._eos_ids()
        self._base = self.model.base_model
        self._head = self.model.get_output_embeddings()

    @staticmethod
    def _load(model_dir: str):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def _eos_ids(self) -> frozenset[int]:
        """EOS ids from the model config, its generation config and the tokenizer, like SGLang."""
        ids: set[int] = set()
        sources = [getattr(self.config, "eos_token_id", None), self.tokenizer.eos_token_id]
        gen = getattr(self.model, "generation_config", None)
        if gen is not None:
            sources.append(getattr(gen, "eos_token_id", None))
        for src in sources:
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, (list, tuple)):
                ids.update(int(x) for x in src)
        return frozenset(ids)

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.config)

    @torch.inference_mode()
    def prefill(self, ids: list[int], cache, *, keep_from: int, images=(), start: int = 0) -> torch.Tensor:
        """Run ``ids[start:]`` through the model into ``cache``; return final hidden states of
        positions ``keep_from..`` (``start <= keep_from``).

        ``start > 0``: ``cache`` already holds the KV of ``ids[:start]`` (a reused prefix). Chunks
        stay aligned to multiples of ``PREFILL_CHUNK``, as in a prefill from 0.
        """
        if images:
            raise ValueError("this model takes no images")
        if not 0 <= start <= keep_from:
            raise ValueError(f"prefill start {start} must be in [0, keep_from={keep_from}]")
        kept = []
        pos = start
        while pos < len(ids):
            end = min(len(ids), (pos // PREFILL_CHUNK + 1) * PREFILL_CHUNK)
            out = self._base(input_ids=torch.tensor([ids[pos:end]]), past_key_values=cache, use_cache=True)
            if end > keep_from:
                kept.append(out.last_hidden_state[0, max(keep_from - pos, 0) :])
            pos = end
        return torch.cat(kept, dim=0)

    @torch.inference_mode()
    def step(self, token: int, cache) -> torch.Tensor:
        """Feed one token; return the logits for the next position (1-D, float32)."""
        out = self._base(input_ids=torch.tensor([[token]]), past_key_values=cache, use_cache=True)
        return self._head(out.last_hidden_state[0, -1]).float()

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor):
        """Yield ``(offset, logits)`` for chunks of rows of ``hidden`` (``[n, d]``)."""
        for start in range(0, hidden.shape[0], LOGITS_CHUNK):
            yield start, self._head(hidden[start : start + LOGITS_CHUNK]).float()

    def load_weights(self, model_dir: str | os.PathLike) -> None:
        """Replace the weights with the safetensors in ``model_dir``; all-or-nothing.

        Raises ValueError (nothing changed) when the dir has no weights, a tensor is missing,
        unexpected, or of a different shape.
        """
        from safetensors.torch import load_file

        folder = Path(model_dir)
        if not folder.is_dir():
            raise ValueError(f"model path {str(model_dir)!r} is not a directory")
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors files in {str(model_dir)!r}")
        loaded: dict[str, torch.Tensor] = {}
        for f in files:
            loaded.update(load_file(str(f)))
        self.load_tensors(loaded, partial=False)
        self.model_dir = str(model_dir)

    def load_tensors(self, loaded: dict[str, torch.Tensor], *, partial: bool) -> None:
        """Copy named tensors into the model; all-or-nothing. ``partial``: a subset of the
        weights (one bucket of a broadcast), so nothing counts as missing.

        Raises ValueError (nothing changed) for an unknown name, a shape mismatch or, unless
        ``partial``, a missing tensor.
        """
        params = dict(self.model.named_parameters(remove_duplicate=False))
        params.update(dict(self.model.named_buffers()))
        loaded = {self.module_name(k): v for k, v in loaded.items()}
        tied = self._tied_names()
        unexpected = sorted(k for k in loaded if k not in params)
        if unexpected:
            raise ValueError(f"unexpected tensors in checkpoint: {unexpected[:5]}")
        missing = [] if partial else sorted(k for k, v in self.model.named_parameters() if k not in loaded and k not in tied)
        if missing:
            raise ValueError(f"tensors missing from checkpoint: {missing[:5]}")
        for k, t in loaded.items():
            if tuple(t.shape) != tuple(params[k].shape):
                raise ValueError(f"shape mismatch for {k}: checkpoint {tuple(t.shape)} vs model {tuple(params[k].shape)}")
        with torch.no_grad():
            for k, t in loaded.items():
                params[k].copy_(t.to(params[k].dtype))

    def weight(self, name: str) -> torch.Tensor | None:
        """The parameter or buffer called ``name`` (a tied head answers with the embedding it
        shares), or None."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        params.update(dict(self.model.named_buffers()))
        return params.get(self.module_name(name))

    def module_name(self, name: str) -> str:
        """The model's parameter name for a checkpoint tensor name (they differ for some architectures)."""
        return name

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _tied_names(self) -> set[str]:
        """Parameter names that share storage with another one (e.g. a tied lm_head)."""
        seen: dict[int, str] = {}
        tied: set[str] = set()
        for name, p in self.model.named_parameters(remove_duplicate=False):
            ptr = p.data_ptr()
            if ptr in seen:
                tied.add(name)
            else:
                seen[ptr] = name
        return tied
