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
