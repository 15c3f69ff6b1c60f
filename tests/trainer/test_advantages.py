"""GRPO advantages: normalized over a group's sessions, shared by a session's samples."""

from __future__ import annotations

import math

import pytest

from trainer_bridge.advantages import group_advantages, token_advantages


def s(session, group, reward):
    return {"session_id": session, "group_id": group, "reward": reward}


def test_group_normalization_by_session():
    samples = [s("a", "g", 1.0), s("a", "g", 1.0), s("b", "g", 0.0), s("c", "g", 0.5), s("x", "h", 3.0), s("y", "h", 1.0)]
    adv = group_advantages(samples, eps=0.0)
    # group g sessions: 1.0, 0.0, 0.5 -> mean 0.5, population std sqrt(1/6); "a" counted once
    std = math.sqrt(((0.5) ** 2 + (0.5) ** 2 + 0) / 3)
    assert adv[0] == adv[1] == pytest.approx(0.5 / std)
    assert adv[2] == pytest.approx(-0.5 / std)
    assert adv[3] == pytest.approx(0.0)
    assert adv[4] == pytest.approx(1.0) and adv[5] == pytest.approx(-1.0)


def test_mean_only_and_degenerate_groups():
    samples = [s("a", "g", 2.0), s("b", "g", 4.0), s("c", "h", 7.0), s("d", "k", 1.0), s("e", "k", 1.0)]
    adv = group_advantages(samples, normalize_std=False)
    assert adv[:2] == [-1.0, 1.0]
    assert adv[2] == 0.0  # a group of one has no baseline to beat
    assert adv[3:] == [0.0, 0.0]  # equal rewards: no signal, no division blow-up


def test_ungrouped_sessions_share_a_batch_baseline():
    samples = [s("a", None, 1.0), s("b", None, 3.0), {"session_id": "c", "reward": 5.0}]
    assert group_advantages(samples, normalize_std=False) == [-2.0, 0.0, 2.0]


def test_conflicting_session_rewards_warn_and_use_the_first():
    with pytest.warns(UserWarning, match="different rewards"):
        adv = group_advantages([s("a", "g", 1.0), s("a", "g", 0.0), s("b", "g", 0.0)], normalize_std=False)
    assert adv == [0.5, 0.5, -0.5]


def test_token_broadcast():
    assert token_advantages(0.25, 3).tolist() == [0.25, 0.25, 0.25]


def test_an_episode_of_several_samples_counts_once_in_its_group():
    """Episode A yielded three samples (main, sub-agent, compacted segment), B and C one each.
    By hand: episode rewards 1.0, 0.0, 0.5 -> mean 0.5, population std sqrt(1/6); A's samples
    all get 0.5 / sqrt(1/6) = 1.2247..., B -1.2247..., C 0. Counting samples instead would put
    the baseline at (1 + 1 + 1 + 0 + 0.5) / 5 = 0.7."""
    samples = [s("A", "g", 1.0), s("A", "g", 1.0), s("A", "g", 1.0), s("B", "g", 0.0), s("C", "g", 0.5)]
    adv = group_advantages(samples, eps=0.0)
    assert adv == pytest.approx([1.224744871391589] * 3 + [-1.224744871391589, 0.0], abs=1e-12)
    assert group_advantages(samples, normalize_std=False) == pytest.approx([0.5, 0.5, 0.5, -0.5, 0.0])


def test_loss_aggregation_weights_by_hand():
    """Loss tokens: A's samples 2, 3, 5 (T_A = 10), B 4, C 6: T = 20, E = 3 episodes, S = 5."""
    from trainer_bridge.advantages import episode_loss_weights

    def smp(session, n_loss, n_ctx=3):
        return {"session_id": session, "loss_mask": [0] * n_ctx + [1] * n_loss}

    samples = [smp("A", 2), smp("A", 3), smp("A", 5), smp("B", 4), smp("C", 6), smp("C", 0)]
    assert episode_loss_weights(samples, "token") == [1.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    # episode: T / (E * T_e) = 20/30, 20/12, 20/18
    ep = episode_loss_weights(samples, "episode")
    assert ep == pytest.approx([2 / 3, 2 / 3, 2 / 3, 5 / 3, 10 / 9, 0.0])
    # each episode's tokens then carry the same total weight T / E
    n = [2, 3, 5, 4, 6, 0]
    assert sum(w * k for w, k in zip(ep[:3], n[:3])) == pytest.approx(20 / 3)
    assert ep[3] * 4 == pytest.approx(20 / 3) and ep[4] * 6 == pytest.approx(20 / 3)
    # sample: T / (S * T_s), S counting samples with a loss token: 20/10, 20/15, 20/25, 20/20, 20/30
    assert episode_loss_weights(samples, "sample") == pytest.approx([2.0, 4 / 3, 0.8, 1.0, 2 / 3, 0.0])
    with pytest.raises(ValueError):
        episode_loss_weights(samples, "sequence")


def test_episode_weighting_scales_each_samples_advantage():
    """`--episode-weighting episode`: an episode of two samples weighs what an episode of one does;
    checked by hand on a group of two sessions, the first of which yields two samples."""
    from splice_trainer_testlib import make_samples
    from trainer_bridge.config import TrainConfig
    from trainer_bridge.train import prepare_batch

    samples = make_samples(n_groups=1, group_size=2, seed=11, version=5)
    assert [s["session_id"] for s in samples] == ["s0-0", "s0-0", "s0-1"]
    base = dict(proxies=["u"], model="m", max_staleness=None)
    kept, plain, _ = prepare_batch(samples, 5, TrainConfig(**base))
    kept_e, weighted, _ = prepare_batch(samples, 5, TrainConfig(**base, episode_weighting="episode"))
    tokens = [sum(s["loss_mask"]) for s in kept]
    total, first_episode = sum(tokens), tokens[0] + tokens[1]
    expected = [plain[0] * total / (2 * first_episode), plain[1] * total / (2 * first_episode),
                plain[2] * total / (2 * tokens[2])]
    assert weighted == pytest.approx(expected)
    # the two episodes' weighted token sums are equal: each counts once
    assert (tokens[0] + tokens[1]) * total / (2 * first_episode) == pytest.approx(tokens[2] * total / (2 * tokens[2]))
