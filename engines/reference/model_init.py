"""Create tiny, seeded Qwen3-architecture models for the reference engine.

The model is random (nothing to download), but it has the real Qwen3 vocabulary and the real
Qwen3 tokenizer and chat template, so every token id, special token and rendered prompt is the
same as with a production Qwen3 checkpoint. ``perturb_model`` writes a nearby copy, which is
what a weight update looks like to the engine.

Heads are 64 wide by default: vLLM's CPU attention does not serve smaller head dims, and the
model stays tiny (hidden size 64; the 151936 x 64 tied embedding is most of its ~10M weights).

``warm_start`` fine-tunes such a model for a few seconds on prompt/completion pairs (loss on
the completion tokens only), so that RL starts from a model that already writes the task's
format (``splice init-model DIR --warm-start FILE``; ``splice demo`` uses it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from .qwen_files import ENDOFTEXT_ID, IM_END_ID, QWEN3_VOCAB_SIZE, TOKENIZER_FILES, tokenizer_files_dir  # noqa: F401 - re-exported

# The bundled model's context: Codex's first prompt is ~8k tokens and Claude Code's 11-21k, and
# their sessions grow from there. Positions cost the tiny model nothing (rotary, no table).
DEFAULT_MAX_POSITIONS = 131072
# What the bundled default model is; part of its cache folder's name, so a model cached by an
# older release (other heads, an 8k context) is never silently reused.
BUNDLED_MODEL = {"head_dim": 64, "hidden_size": 64, "num_hidden_layers": 2, "max_position_embeddings": DEFAULT_MAX_POSITIONS}
BUNDLED_MODEL_NAME = "tiny-qwen3-hd64-ctx128k-seed0"


def init_model(
    out_dir: str | os.PathLike,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    intermediate_size: int = 128,
    max_position_embeddings: int = DEFAULT_MAX_POSITIONS,
    initializer_range: float = 0.3,
) -> Path:
    """Write a random Qwen3ForCausalLM (float32 safetensors) plus the Qwen3 tokenizer to ``out_dir``.

    ``head_dim`` is independent of ``hidden_size`` (Qwen3 projects to ``num_heads * head_dim``);
    keep it at 64 or more for engines with fused attention kernels (vLLM's CPU backend).

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
    return Path(home) / "models" / BUNDLED_MODEL_NAME


def _is_bundled_model(path: Path) -> bool:
    """Whether ``path`` holds the bundled model as this release defines it (config and weights)."""
    if not ((path / "config.json").is_file() and any(path.glob("*.safetensors"))):
        return False
    try:
        cfg = read_config(path)
    except (OSError, ValueError):
        return False
    return all(cfg.get(k) == v for k, v in BUNDLED_MODEL.items())


def ensure_model(path: str | os.PathLike | None = None, *, seed: int = 0) -> Path:
    """Return ``path`` (default: ``default_model_dir()``), creating the tiny model there if missing.

    Written to a temporary sibling and renamed, so a crash never leaves a half-written model.
    The default folder is also checked against ``BUNDLED_MODEL``: a stale or hand-edited cache
    there is rebuilt rather than served with the wrong context. A ``path`` given by the user is
    theirs: an existing model there is used as it is.
    """
    target = Path(path) if path is not None else default_model_dir()
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        if path is not None or _is_bundled_model(target):
            return target
        stale = target.with_name(f"{target.name}.stale-{os.getpid()}")
        os.replace(target, stale)
        shutil.rmtree(stale, ignore_errors=True)
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


def read_warm_start(path: str | os.PathLike) -> list[tuple[str, str]]:
    """Prompt/completion pairs from a JSONL file: one ``{"prompt": str, "completion": str}`` per line.

    Both are raw text in the model's own format (chat template already applied); special
    tokens written in the text (``<|im_end|>``) are encoded as special tokens.
    """
    pairs = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row.get("prompt"), str) or not isinstance(row.get("completion"), str) or not row["completion"]:
            raise ValueError(f"{path}:{n}: expected {{\"prompt\": str, \"completion\": non-empty str}}")
        pairs.append((row["prompt"], row["completion"]))
    if not pairs:
        raise ValueError(f"{path}: no prompt/completion pairs")
    return pairs


def warm_start(
    model_dir: str | os.PathLike,
    pairs: Sequence[tuple[str, str]],
    *,
    steps: int = 60,
    batch_size: int = 16,
    lr: float = 1e-2,
    seed: int = 0,
    threads: int | None = None,
    on_step: Callable[[int, int, float], None] | None = None,
) -> list[float]:
    """Fine-tune the model in ``model_dir`` in place on ``pairs`` (cross-entropy on completion tokens).

    ``steps`` Adam steps on ``batch_size`` pairs drawn with replacement (seeded). The LM head
    only runs on completion positions, so a step costs a fraction of a second on a CPU for the
    tiny model. ``on_step(step, steps, loss)`` is called after every step. Returns the losses.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()
    if threads:
        torch.set_num_threads(threads)
    model_dir = Path(model_dir)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    encoded: list[tuple[list[int], list[int]]] = []
    cache: dict[str, list[int]] = {}

    def enc(text: str) -> list[int]:
        if text not in cache:
            cache[text] = tok(text, add_special_tokens=False)["input_ids"]
        return cache[text]

    for prompt, completion in pairs:
        encoded.append((enc(prompt), enc(completion)))
    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    except TypeError:  # transformers < 4.56
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    model.train()
    for m in model.modules():  # dropout off: the result should not depend on it
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    head = model.get_output_embeddings()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            opt = torch.optim.Adam(model.parameters(), lr=lr, fused=True)
        except (RuntimeError, TypeError):  # no fused CPU Adam in this torch
            opt = torch.optim.Adam(model.parameters(), lr=lr)
        rng = random.Random(seed)
        losses: list[float] = []
        pad = int(model.config.pad_token_id or 0)
        for step in range(1, steps + 1):
            rows = [encoded[rng.randrange(len(encoded))] for _ in range(batch_size)]
            width = max(len(p) + len(c) for p, c in rows)
            ids = torch.full((len(rows), width), pad, dtype=torch.long)
            att = torch.zeros_like(ids)
            b_idx, pos, target = [], [], []
            for b, (p, c) in enumerate(rows):
                x = p + c
                ids[b, : len(x)] = torch.tensor(x)
                att[b, : len(x)] = 1
                for j in range(len(p), len(x)):  # logits at j-1 predict token j
                    b_idx.append(b)
                    pos.append(j - 1)
                    target.append(x[j])
            hidden = model.base_model(input_ids=ids, attention_mask=att, use_cache=False).last_hidden_state
            logits = head(hidden[torch.tensor(b_idx), torch.tensor(pos)])
            loss = torch.nn.functional.cross_entropy(logits.float(), torch.tensor(target))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(float(loss.item()))
            if on_step is not None:
                on_step(step, steps, losses[-1])
    model.eval()
    model.save_pretrained(str(model_dir), safe_serialization=True)
    return losses


def main(argv: list[str] | None = None) -> int:
    """CLI: ``init-model DIR [--vision] [--seed N] [--hidden-size N] [--layers N] [--head-dim N] [--max-position-embeddings N] [--warm-start FILE] [--perturb-from DIR]``."""
    p = argparse.ArgumentParser(prog="init-model", description="write a tiny random Qwen3 model with the real Qwen3 tokenizer")
    p.add_argument("dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads")
    p.add_argument("--head-dim", type=int, default=64, help="per-head width (vLLM's CPU attention needs 64 or more)")
    p.add_argument("--max-position-embeddings", type=int, default=DEFAULT_MAX_POSITIONS, metavar="N",
                   help=f"context length in tokens (default {DEFAULT_MAX_POSITIONS}; costs a tiny model nothing)")
    p.add_argument("--initializer-range", type=float, default=0.3,
                   help="std of the random weights (large: peaked next-token distributions)")
    p.add_argument("--warm-start", metavar="FILE",
                   help="then fine-tune on this JSONL of {\"prompt\", \"completion\"} pairs (loss on completions)")
    p.add_argument("--warm-start-steps", type=int, default=60)
    p.add_argument("--warm-start-batch", type=int, default=16)
    p.add_argument("--warm-start-lr", type=float, default=1e-2)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads for the warm start")
    p.add_argument("--perturb-from", metavar="DIR", help="instead, write a perturbed copy of DIR (noise seeded by --seed)")
    p.add_argument("--scale", type=float, default=0.05, help="noise scale for --perturb-from")
    p.add_argument("--vision", action="store_true",
                   help="instead, write the tiny Qwen2.5-VL-architecture vision-language model (seeded by --seed) "
                        "with its image processor config and the family chat template")
    a = p.parse_args(argv)
    if a.vision:
        if a.perturb_from or a.warm_start:
            p.error("--vision cannot be combined with --perturb-from or --warm-start")
        from .vision_files import init_vision_model

        print(init_vision_model(a.dir, seed=a.seed), flush=True)
        return 0
    if a.max_position_embeddings < 16:
        p.error("--max-position-embeddings must be at least 16")
    if a.head_dim < 1 or a.heads < 1 or a.kv_heads < 1 or a.heads % a.kv_heads:
        p.error("--head-dim, --heads and --kv-heads must be positive, --heads a multiple of --kv-heads")
    if a.perturb_from:
        out = perturb_model(a.perturb_from, a.dir, seed=a.seed, scale=a.scale)
    else:
        out = init_model(
            a.dir, seed=a.seed, hidden_size=a.hidden_size, num_layers=a.layers, num_heads=a.heads,
            num_kv_heads=a.kv_heads, head_dim=a.head_dim, initializer_range=a.initializer_range,
            max_position_embeddings=a.max_position_embeddings,
        )
        if a.warm_start:
            pairs = read_warm_start(a.warm_start)
            t0 = time.monotonic()
            every = max(1, a.warm_start_steps // 20)

            def report(step: int, steps: int, loss: float) -> None:
                if step % every == 0 or step == steps:
                    print(f"warm start step {step}/{steps} loss {loss:.3f} ({time.monotonic() - t0:.1f}s)", flush=True)

            warm_start(out, pairs, steps=a.warm_start_steps, batch_size=a.warm_start_batch, lr=a.warm_start_lr,
                       seed=a.seed, threads=a.threads, on_step=report)
    print(out, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
