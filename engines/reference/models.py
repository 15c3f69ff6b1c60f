"""Which model class serves a folder: text-only (``lm``) or vision-language (``vision_lm``)."""

from __future__ import annotations

import os

from .lm import LanguageModel, is_vision_model_dir
from .vision_lm import VisionLanguageModel


def load_language_model(model_dir: str | os.PathLike) -> LanguageModel:
    """The right ``LanguageModel`` for ``model_dir``: a vision-language one when its config says so."""
    if is_vision_model_dir(model_dir):
        return VisionLanguageModel(model_dir)
    return LanguageModel(model_dir)
