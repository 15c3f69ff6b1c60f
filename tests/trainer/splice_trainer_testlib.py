"""Shared helpers for the trainer tests: a tiny local model and synthetic pulled samples.

Imported by the test modules (via conftest's sys.path entry) and by the torchrun worker script.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

VOCAB = 256


def make_tiny_model_dir(path: str | Path, *, seed: int = 0, vocab: int = VOCAB) -> Path:
    """A 2-layer Qwen3-architecture model saved as safetensors, plus a stand-in tokenizer file."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    model = Qwen3ForCausalLM(cfg)
    path = Path(path)
    model.save_pretrained(path)
    (path / "tokenizer_config.json").write_text('{"model_max_length": 512}')
    (path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "WordLevel", "vocab": {}}}')
    return path


def make_samples(
    n_groups: int = 3,
    group_size: int = 2,
    *,
    version: int = 5,
    seed: int = 0,
    vocab: int = VOCAB,
    min_len: int = 6,
    max_len: int = 24,
    prefix: str = "s",
) -> list[dict[str, Any]]:
    """Pull-API samples: prompt (mask 0) then 1-2 completion segments, token versions up to ``version``.

    The first session of each group forks into a second sample (same session, same reward).
    """
    rng = random.Random(seed)
    samples = []
    for g in range(n_groups):
        for k in range(group_size):
            session = f"{prefix}{g}-{k}"
            reward = float(rng.choice([0.0, 0.5, 1.0]) + k)  # distinct within the group
            for fork in range(2 if k == 0 else 1):
                samples.append(_sample(rng, f"{session}-{fork}", session, f"{prefix}g{g}", reward, version, vocab, min_len, max_len))
    return samples


def _sample(rng, sample_id, session, group, reward, version, vocab, min_len, max_len) -> dict[str, Any]:
    length = rng.randint(min_len, max_len)
    prompt = rng.randint(1, max(1, length // 3))
    ids = [rng.randrange(vocab) for _ in range(length)]
    mask, lp, ver, pt, pv = [], [], [], [], []
    split = rng.randint(prompt, length)
    for i in range(length):
        if i < prompt or (i == split and i < length - 1):  # a tool-result token in the middle
            mask.append(0), lp.append(0.0), ver.append(-1), pt.append(0.0), pv.append(-1)
            continue
        v = version - 1 if i < split else version
        behav = -rng.uniform(0.5, 6.0)
        mask.append(1)
        lp.append(behav)
        ver.append(v)
        if v < version:  # recomputed under v+1 by the proxy
            pt.append(behav + rng.uniform(-0.3, 0.3))
            pv.append(v + 1)
        else:
            pt.append(behav)
            pv.append(v)
    return {
        "sample_id": sample_id,
        "session_id": session,
        "group_id": group,
        "reward": reward,
        "input_ids": ids,
        "loss_mask": mask,
        "logprobs": lp,
        "versions": ver,
        "proximal_logprobs_t": pt,
        "proximal_versions": pv,
    }


#: Config for synthetic samples: their behaviour log-probs are random, not the model's, so the
#: engine-trainer mismatch guards (on by default) would mask or reweight nearly every fresh token.
SYNTHETIC_GUARDS_OFF: dict[str, Any] = {"tis_cap": None, "mis_low": None, "mis_high": None}
