"""Worker of ``splice bench train``: training steps on synthetic agent samples, measured per rank.

Run by ``proxy/bench/train.py`` (``python -m trainer_bridge.bench`` for one process, under
``torchrun`` for several). Builds the learner exactly as ``splice train`` does (FSDP2, packing,
balance), feeds it a batch of log-uniform sample lengths, and records per rank: bytes of
parameters / gradients / AdamW state held locally (the shards), peak RSS, step time, and the
plan's padding share and imbalance. Rank 0 writes everything as JSON to ``--out``.

Usage: python -m trainer_bridge.bench --model DIR --out FILE [--samples N] [--steps N] ...
       python -m trainer_bridge.bench --make-model DIR [--hidden H --layers L --vocab V]  (prints its size)
"""

from __future__ import annotations

import argparse
import json
import math
import random
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from . import distributed
from .config import TrainConfig
from .learner import build_learner, learner_step
from .sharding import state_bytes


def make_model_dir(path: str | Path, *, hidden: int, layers: int, vocab: int, seed: int = 0) -> tuple[Path, int]:
    """A randomly initialised Qwen3-architecture model saved as safetensors; returns (dir, params)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    heads = max(1, hidden // 64)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=64,
                      max_position_embeddings=16384, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg)
    path = Path(path)
    model.save_pretrained(path)
    return path, sum(p.numel() for p in model.parameters())


def synthetic_samples(n: int, lo: int, hi: int, vocab: int, version: int, seed: int) -> list[dict[str, Any]]:
    """Agent-like samples: log-uniform lengths in [lo, hi], a prompt, then loss tokens of two versions."""
    rng = random.Random(seed)
    out = []
    for k in range(n):
        length = int(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        prompt = max(1, length // 4)
        versions = [-1] * prompt + [version - rng.randint(0, 1) for _ in range(length - prompt)]
        behav = [0.0] * prompt + [-rng.uniform(0.5, 4.0) for _ in range(length - prompt)]
        out.append({
            "sample_id": f"b{k}", "session_id": f"b{k}", "group_id": f"g{k // 2}", "reward": float(k % 2),
            "input_ids": [rng.randrange(vocab) for _ in range(length)],
            "loss_mask": [0] * prompt + [1] * (length - prompt),
            "logprobs": behav,
            "versions": versions,
            "proximal_logprobs_t": [b + (0.1 if 0 <= v < version else 0.0) for b, v in zip(behav, versions)],
            "proximal_versions": [v + 1 if 0 <= v < version else v for v in versions],
        })
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer_bridge.bench")
    ap.add_argument("--model")
    ap.add_argument("--out")
    ap.add_argument("--make-model", metavar="DIR", help="write a random model of this shape to DIR and exit")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--samples", type=int, default=12)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=8000)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--micro-batch-tokens", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.make_model:
        print(make_model_dir(args.make_model, hidden=args.hidden, layers=args.layers, vocab=args.vocab)[1])
        return 0
    if not (args.model and args.out):
        ap.error("--model and --out are required")

    dist = distributed.setup("auto")
    config = TrainConfig(proxies=["unused"], model=args.model, micro_batch_tokens=args.micro_batch_tokens,
                         ppo_n_minibatches=1, lr=1e-5, progress=False)
    learner = build_learner(config, dist)
    vocab = learner.policy.model.config.vocab_size
    samples = synthetic_samples(args.samples, args.min_len, args.max_len, vocab, version=5, seed=args.seed)
    advantages = [1.0 if s["reward"] else -1.0 for s in samples]
    steps = []
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        stats = learner_step(learner, samples if dist.is_main else [], advantages if dist.is_main else [], config,
                             step, version=5)
        if dist.device.type == "cuda":
            torch.cuda.synchronize()
        steps.append({"time_s": time.perf_counter() - t0, "imbalance": stats["imbalance"],
                      "imbalance_tokens": stats["imbalance_tokens"], "padding_frac": stats["padding_frac"],
                      "padding_frac_unpacked": stats["padding_frac_unpacked"], "loss": stats["loss"]})
    local = {
        "rank": dist.rank,
        **state_bytes(learner.policy, learner.optimizer),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "n_params": sum(p.numel() for p in learner.policy.parameters()),
    }
    ranks = distributed.gather(dist, local)
    if dist.is_main:
        tokens = sum(len(s["input_ids"]) for s in samples)
        Path(args.out).write_text(json.dumps({
            "world_size": dist.world_size, "device": str(dist.device), "tokens_per_step": tokens,
            "steps": steps, "ranks": ranks,
        }, indent=1))
    distributed.teardown(dist)
    return 0


if __name__ == "__main__":
    sys.exit(main())
