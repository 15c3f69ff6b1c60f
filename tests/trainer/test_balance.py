"""Minibatches cut by tokens, samples spread over ranks by cost, and the step plan built from them."""

from __future__ import annotations

import math
import random

import pytest

from trainer_bridge.balance import assign_to_ranks, attention_weight, imbalance, minibatches_by_tokens, sample_cost
from trainer_bridge.plan import plan_step


def log_uniform(n: int, seed: int, lo: int = 100, hi: int = 8000) -> list[int]:
    rng = random.Random(seed)
    return [int(math.exp(rng.uniform(math.log(lo), math.log(hi)))) for _ in range(n)]


def test_minibatches_partition_and_cut_by_tokens():
    lengths = log_uniform(64, 1)
    for k in (1, 2, 4, 7):
        mbs = minibatches_by_tokens(lengths, k, seed=3)
        assert len(mbs) == k and all(mbs)
        assert sorted(i for mb in mbs for i in mb) == list(range(64))
        totals = [sum(lengths[i] for i in mb) for mb in mbs]
        # each cut lands within one sample of its boundary
        assert max(totals) - min(totals) <= 2 * max(lengths)
    assert minibatches_by_tokens(lengths, 3, seed=3) == minibatches_by_tokens(lengths, 3, seed=3)
    assert len(minibatches_by_tokens([10, 20], 5, seed=0)) == 2  # never an empty minibatch
    assert minibatches_by_tokens([], 2, seed=0) == []


@pytest.mark.parametrize("world", [2, 4, 8])
def test_longest_first_beats_round_robin(world):
    worse = []
    for seed in range(5):
        lengths = log_uniform(8 * world, seed)
        costs = [sample_cost(n, 1 / 4000) for n in lengths]
        parts = assign_to_ranks(costs, world)
        assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
        lpt = imbalance([sum(costs[i] for i in p) for p in parts])
        rr = imbalance([sum(costs[i] for i in range(r, len(costs), world)) for r in range(world)])
        assert lpt <= 1.1  # the balance target for log-uniform 100-8,000 token samples
        worse.append(rr)
        # LPT's guarantee: no rank above the mean plus the largest single cost
        assert max(sum(costs[i] for i in p) for p in parts) <= sum(costs) / world + max(costs) + 1e-9
    assert max(worse) > 1.1  # dealing round-robin does not get there


def test_attention_weight_from_config():
    class Cfg:  # Qwen3-8B's shape
        hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads = 4096, 36, 32, 8
        head_dim, intermediate_size, vocab_size = 128, 12288, 151936

    w = attention_weight(Cfg())
    linear = 2 * (36 * (4096 * 128 * (2 * 32 + 2 * 8) + 3 * 4096 * 12288) + 4096 * 151936)
    assert w == pytest.approx(4 * 36 * 32 * 128 / linear)
    assert 1 / 40000 < w < 1 / 20000  # a 30k-token sample: attention about as costly as the rest


def sample(n: int, loss: int) -> dict:
    return {"input_ids": [1] * n, "loss_mask": [0] * (n - loss) + [1] * loss}


def test_plan_step_gives_every_sample_once_and_equal_micro_batch_counts():
    lengths = log_uniform(21, 4, lo=10, hi=400)
    samples = [sample(n, max(1, n // 3)) for n in lengths]
    samples[5]["loss_mask"] = [0] * lengths[5]  # no loss token: not counted as a sample
    adv = [float(i) for i in range(21)]
    shares = plan_step(samples, adv, world_size=3, n_minibatches=2, micro_batch_tokens=256, seed=0,
                       attn_weight=1e-3, loss_agg="token-mean")
    seen = []
    for k in range(2):
        n_micro = {s.n_micro[k] for s in shares}
        assert len(n_micro) == 1  # every rank runs the same number of forwards/backwards
        tokens = sum(sum(sum(m["loss_mask"]) for m in group) for s in shares for group, _ in s.minibatches[k])
        assert {s.normalizers[k] for s in shares} == {float(tokens)}
        for s in shares:
            assert len(s.minibatches[k]) <= s.n_micro[k]
            for group, advs in s.minibatches[k]:
                assert sum(len(m["input_ids"]) for m in group) <= 256 or len(group) == 1
                seen.extend(int(a) for a in advs)
                assert [adv[int(a)] for a in advs] == advs
    assert sorted(seen) == list(range(21))
    stats = shares[0].stats
    assert 1.0 <= stats["imbalance"] < 1.5 and 0.0 <= stats["padding_frac"] < 0.05
    seq = plan_step(samples, adv, world_size=3, n_minibatches=2, micro_batch_tokens=256, seed=0, loss_agg="seq-mean-token-mean")
    assert sum(seq[0].normalizers) == 20  # samples with a loss token


def test_more_ranks_than_samples_get_fillers():
    shares = plan_step([sample(10, 5)], [1.0], world_size=4, n_minibatches=1, micro_batch_tokens=64, seed=0)
    assert [len(s.minibatches[0]) for s in shares].count(1) == 1
    assert all(s.n_micro == [1] for s in shares)  # the three empty ranks each run one filler
