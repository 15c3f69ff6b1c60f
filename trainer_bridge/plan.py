"""Rank 0's plan for one training step: which rank trains which samples, in which micro-batches.

The batch is cut into ``ppo_n_minibatches`` minibatches by tokens; each minibatch's samples are
spread over ranks by cost (``balance.py``) and each rank's share is packed into micro-batches of
at most ``micro_batch_tokens`` tokens (``batching.plan_packs``). Under FSDP every rank must run
the same number of forward/backward passes, so a rank with fewer micro-batches gets zero-weight
filler micro-batches (two tokens each). Those, and row ends when a micro-batch is laid out in
several rows (attention without varlen kernels), are the step's only padding.

Each rank is then sent only its own :class:`RankShare` (``distributed.scatter``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .balance import assign_to_ranks, imbalance, minibatches_by_tokens, sample_cost
from .batching import EMPTY_TOKENS, pack_rows, plan_packs


@dataclass
class RankShare:
    """One rank's part of a step. Per minibatch: its micro-batches, each ``(samples, advantages)``;
    how many micro-batches every rank runs; the minibatch-wide loss normaliser."""

    minibatches: list[list[tuple[list[dict[str, Any]], list[float]]]] = field(default_factory=list)
    n_micro: list[int] = field(default_factory=list)
    normalizers: list[float] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)  # the plan's stats (the same on every rank)


def n_loss_tokens(sample: dict[str, Any]) -> int:
    return sum(1 for m in sample["loss_mask"] if m)


def plan_step(
    samples: Sequence[dict[str, Any]],
    advantages: Sequence[float],
    *,
    world_size: int,
    n_minibatches: int,
    micro_batch_tokens: int,
    seed: int,
    attn_weight: float = 0.0,
    loss_agg: str = "token-mean",
    rows: str = "one",
) -> list[RankShare]:
    """One :class:`RankShare` per rank. ``seed`` fixes the minibatch shuffle; ``rows`` is the
    micro-batch layout (:func:`~.batching.pack_rows`), for the padding it costs."""
    lengths = [len(s["input_ids"]) for s in samples]
    shares = [RankShare() for _ in range(world_size)]
    imbalances, token_imbalances = [], []
    real = filler = padded_layout = 0
    for mb in minibatches_by_tokens(lengths, n_minibatches, seed):
        costs = [sample_cost(lengths[i], attn_weight) for i in mb]
        by_rank = [[mb[j] for j in part] for part in assign_to_ranks(costs, world_size)]
        packs = []
        for idx in by_rank:
            groups = plan_packs([lengths[i] for i in idx], micro_batch_tokens)
            packs.append([[idx[g] for g in group] for group in groups])
        n_micro = max(1, max(len(p) for p in packs))
        if loss_agg == "token-mean":
            normalizer = float(sum(n_loss_tokens(samples[i]) for i in mb))
        else:
            normalizer = float(sum(1 for i in mb if n_loss_tokens(samples[i]) > 0))
        for r, share in enumerate(shares):
            share.minibatches.append([([samples[i] for i in g], [float(advantages[i]) for i in g]) for g in packs[r]])
            share.n_micro.append(n_micro)
            share.normalizers.append(normalizer)
            filler += (n_micro - len(packs[r])) * EMPTY_TOKENS
            for g in packs[r]:
                layout, width = pack_rows([lengths[i] for i in g], rows, attn_weight)
                filler += len(layout) * width - sum(lengths[i] for i in g)  # row-end padding
        rank_costs = [sum(sample_cost(lengths[i], attn_weight) for i in idx) for idx in by_rank]
        rank_tokens = [sum(lengths[i] for i in idx) for idx in by_rank]
        imbalances.append(imbalance(rank_costs))
        token_imbalances.append(imbalance(rank_tokens))
        real += sum(lengths[i] for i in mb)
        # what one padded row per sample (the layout before packing) would have cost, for comparison
        padded_layout += sum(len(g) * max(lengths[i] for i in g) for p in packs for g in p)
    stats = {
        "imbalance": max(imbalances) if imbalances else 1.0,
        "imbalance_mean": sum(imbalances) / len(imbalances) if imbalances else 1.0,
        "imbalance_tokens": max(token_imbalances) if token_imbalances else 1.0,
        "padding_frac": filler / (real + filler) if real + filler else 0.0,
        "padding_frac_unpacked": 1.0 - real / padded_layout if padded_layout else 0.0,
        "n_micro_batches": sum(shares[0].n_micro),
    }
    for share in shares:
        share.stats = stats
    return shares
