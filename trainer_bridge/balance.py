"""Spread a step's samples over minibatches and ranks so that no rank waits on another.

Agent samples range from a hundred tokens to a hundred thousand. Cutting minibatches by sample
count and dealing samples round-robin leaves one rank with the 100k-token sample while the others
idle at every collective. Here:

* minibatches are cut from the shuffled batch **by tokens** (near-equal token totals);
* within a minibatch, samples go to ranks **greedy longest-first** (LPT) by cost
  ``tokens + attention_weight * tokens**2``: the linear layers cost per token, attention per
  pair of tokens of the same sample (packing keeps attention within a sample).

Everything here is plain Python on lengths, so rank 0 plans and the plan is testable alone.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from itertools import accumulate
from collections.abc import Sequence

import torch


def attention_weight(config: object) -> float:
    """Cost of one attended token pair relative to one token through the linear layers.

    Per token the linear layers cost ~``2 * n_params`` FLOPs; each (query, key) pair costs
    ~``4 * layers * heads * head_dim`` (scores plus the weighted sum). From a transformers config
    (a vision-language model's text config: the decoder is what runs over every token).
    """
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    head_dim = int(getattr(config, "head_dim", 0) or (hidden // heads if heads else 0))
    inter = int(getattr(config, "intermediate_size", 0) or 4 * hidden)
    kv = int(getattr(config, "num_key_value_heads", 0) or heads)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    per_layer = hidden * head_dim * (2 * heads + 2 * kv) + 3 * hidden * inter
    linear = 2 * (layers * per_layer + hidden * vocab)
    return (4 * layers * heads * head_dim) / linear if linear else 0.0


def sample_cost(length: int, attn_weight: float) -> float:
    return length + attn_weight * length * length


def minibatches_by_tokens(lengths: Sequence[int], n_minibatches: int, seed: int) -> list[list[int]]:
    """Shuffle ``range(n)`` (seeded, the same on every run) and cut it into ``k`` contiguous
    minibatches with near-equal token totals (each non-empty)."""
    n = len(lengths)
    if n == 0:
        return []
    k = max(1, min(n_minibatches, n))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    prefix = list(accumulate(lengths[i] for i in perm))  # prefix[c - 1]: tokens of the first c samples
    total = prefix[-1]
    cuts: list[int] = []
    prev = 0
    for j in range(1, k):
        target = j * total / k
        c = bisect_left(prefix, target) + 1
        if c >= 2 and abs(prefix[c - 2] - target) <= abs(prefix[c - 1] - target):
            c -= 1  # stopping one sample short lands closer to the boundary
        c = min(max(c, prev + 1), n - (k - j))
        cuts.append(c)
        prev = c
    bounds = [0, *cuts, n]
    return [perm[bounds[i] : bounds[i + 1]] for i in range(k)]


def assign_to_ranks(costs: Sequence[float], world_size: int) -> list[list[int]]:
    """Greedy longest-first: each item (largest cost first) goes to the least-loaded rank."""
    loads = [(0.0, r) for r in range(world_size)]
    heapq.heapify(loads)
    out: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, r = heapq.heappop(loads)
        out[r].append(i)
        heapq.heappush(loads, (load + costs[i], r))
    return out


def imbalance(loads: Sequence[float]) -> float:
    """Busiest rank over the mean rank (1.0 is perfect balance)."""
    mean = sum(loads) / len(loads) if loads else 0.0
    return max(loads) / mean if mean > 0 else 1.0
