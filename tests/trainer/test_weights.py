"""``trainer_bridge.weights.behaviour_weights`` (NumPy) as the importance weight of a vanilla PPO
loss written here in float64 reproduces ``decoupled_ppo_loss`` in segment-wise mode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer_bridge.loss import decoupled_ppo_loss
from trainer_bridge.weights import behaviour_weights


def vanilla_ppo(logp, old, adv, mask, weights, *, eps=0.2, eps_hi=None, c_clip=None):
    """Textbook clipped PPO with per-token importance weights, token mean over the loss mask."""
    eps_hi = eps if eps_hi is None else eps_hi
    r = np.exp(np.where(mask, logp - old, 0.0))
    pg = np.maximum(-adv * r, -adv * np.clip(r, 1 - eps, 1 + eps_hi))
    if c_clip is not None:
        pg = np.where((adv < 0) & (pg > c_clip * np.abs(adv)), c_clip * np.abs(adv), pg)
    return float((pg * weights).sum() / max(1, mask.sum()))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kw", [{}, {"eps_hi": 0.28}, {"c_clip": 3.0}])
def test_vanilla_ppo_with_behaviour_weights_equals_decoupled_loss(seed, kw):
    rng = np.random.default_rng(seed)
    n = 4096  # packed 1-D: several samples back to back
    mask = rng.random(n) < 0.6
    behav = np.where(mask, -rng.gamma(2.0, 0.6, n), 0.0).astype(np.float32)  # float32 as the pull gives them
    prox_t = np.where(mask, behav + rng.normal(0, 0.9, n), 0.0).astype(np.float32)  # some weights leave [0.2, 5]
    old = np.where(mask, behav + rng.normal(0, 0.3, n), 0.0)  # the trainer's own pass at the step start
    logp = old + rng.normal(0, 0.2, n)
    adv = np.repeat(rng.normal(0, 1, n // 512), 512)

    weights, keep = behaviour_weights(behav, prox_t, cap=5.0, floor=0.2, loss_mask=mask)
    assert 0 < (mask & ~keep).sum() < mask.sum()  # the cap/floor actually dropped some tokens
    ours = vanilla_ppo(logp, old, adv, mask, weights, eps=0.2, **kw)

    t = lambda a: torch.as_tensor(np.asarray(a, dtype=np.float64))  # noqa: E731
    loss, _ = decoupled_ppo_loss(
        logprobs=t(logp), proximal_logprobs=t(old), old_logprobs=t(behav), proximal_logprobs_t=t(prox_t),
        advantages=t(adv), loss_mask=torch.as_tensor(mask), eps_clip=0.2, eps_clip_higher=kw.get("eps_hi"),
        c_clip=kw.get("c_clip"), behav_weight="segment", behav_imp_weight_cap=5.0, behav_imp_weight_floor=0.2,
    )  # fmt: skip
    # the same loss up to float64 summation order (numpy and torch add in different orders) ...
    assert float(loss) == pytest.approx(ours, rel=1e-13, abs=1e-15)
    # ... from the same weights: torch's float64 exp of the same segment log-ratio, to 1 ulp
    # (NumPy's and torch's exp round differently on some inputs)
    torch_w = torch.exp(torch.where(torch.as_tensor(mask), t(prox_t) - t(behav), 0.0)).numpy()
    np.testing.assert_array_max_ulp(weights[keep], torch_w[keep], maxulp=1)


def test_weights_by_hand():
    lp = np.array([0.0, -1.0, -1.0, -1.0, -2.0], np.float32)
    prox = np.array([0.0, -0.5, -3.0, 1.0, -2.0], np.float32)
    w, keep = behaviour_weights(lp, prox, cap=5.0, floor=0.2, loss_mask=[0, 1, 1, 1, 1])
    assert keep.tolist() == [False, True, False, False, True]  # e^-2 < 0.2, e^2 > 5
    assert w.tolist() == [0.0, np.exp(0.5), 0.0, 0.0, 1.0]
    w, keep = behaviour_weights(lp, prox, cap=None, floor=None)
    assert keep.all() and w[3] == np.exp(2.0)
    with pytest.raises(ValueError):
        behaviour_weights(lp, prox[:3])


def test_weights_module_needs_no_torch():
    import subprocess
    import sys

    code = "import sys; sys.modules['torch'] = None; import trainer_bridge.weights as w; print(w.behaviour_weights([0.0], [0.0]))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
