"""decoupled_ppo_loss against an independent per-token float64 reference (docs/design.md section 6)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from trainer_bridge.loss import decoupled_ppo_loss, stats_to_floats


def reference(inputs, *, eps_clip, eps_clip_higher, c_clip, behav_weight, cap, floor):
    """Plain-python transcription of docs/design.md section 6, one token at a time."""
    eps_hi = eps_clip if eps_clip_higher is None else eps_clip_higher
    lp, prox, old, prox_t, adv, mask = (inputs[k].reshape(-1).tolist() for k in ("lp", "prox", "old", "prox_t", "adv", "mask"))
    total, n = 0.0, 0
    ws, kls, clipped, dual, masked = [], [], 0, 0, 0
    for i in range(len(lp)):
        if not mask[i]:
            continue
        n += 1
        a = adv[i]
        r = math.exp(lp[i] - prox[i])
        r_clip = min(max(r, 1 - eps_clip), 1 + eps_hi)
        pg = max(-a * r, -a * r_clip)
        if -a * r_clip > -a * r:
            clipped += 1
        if c_clip is not None and a < 0 and pg > c_clip * abs(a):
            pg = c_clip * abs(a)
            dual += 1
        kl = {"segment": prox_t[i] - old[i], "decoupled": prox[i] - old[i], "off": 0.0}[behav_weight]
        w = math.exp(kl)
        ws.append(w)
        kls.append(kl)
        if (cap is not None and w > cap) or (floor is not None and w < floor):
            masked += 1
            continue
        total += pg * w
    mean_w = sum(ws) / n
    return {
        "loss": total / max(n, 1),
        "clip_frac": clipped / n,
        "dual_clip_frac": dual / n,
        "masked_frac": masked / n,
        "behav_imp_weight_mean": mean_w,
        "behav_imp_weight_std": math.sqrt(sum((w - mean_w) ** 2 for w in ws) / n),
        "behav_imp_weight_max": max(ws),
        "behav_kl_mean": sum(kls) / n,
        "n_tokens": n,
    }


def random_inputs(seed, shape=(3, 17), spread=0.6):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(shape, generator=g, dtype=torch.float64) * 5
    return {
        "old": old,
        "prox_t": old + (torch.rand(shape, generator=g, dtype=torch.float64) - 0.5) * 4 * spread,  # w in ~[0.3, 3.3]
        "prox": old + (torch.rand(shape, generator=g, dtype=torch.float64) - 0.5) * 4 * spread,
        "lp": old + (torch.rand(shape, generator=g, dtype=torch.float64) - 0.5) * 2 * spread,
        "adv": torch.randn(shape, generator=g, dtype=torch.float64) * 2,
        "mask": (torch.rand(shape, generator=g) < 0.7).to(torch.float64),
    }


def run(inputs, **kw):
    return decoupled_ppo_loss(
        logprobs=inputs["lp"],
        proximal_logprobs=inputs["prox"],
        old_logprobs=inputs["old"],
        proximal_logprobs_t=inputs["prox_t"],
        advantages=inputs["adv"],
        loss_mask=inputs["mask"],
        **kw,
    )


CASES = list(
    itertools.product(
        ["segment", "decoupled", "off"],  # behav_weight
        [None, 3.0],  # c_clip
        [(5.0, 0.2), (1.5, 0.7), (None, None)],  # cap, floor
        [None, 0.28],  # eps_clip_higher
    )
)


@pytest.mark.parametrize("behav_weight,c_clip,cap_floor,eps_hi", CASES)
def test_matches_reference(behav_weight, c_clip, cap_floor, eps_hi):
    cap, floor = cap_floor
    for seed in range(3):
        inputs = random_inputs(seed)
        kw = dict(eps_clip=0.2, eps_clip_higher=eps_hi, c_clip=c_clip, behav_weight=behav_weight)
        loss, stats = run(inputs, behav_imp_weight_cap=cap, behav_imp_weight_floor=floor, **kw)
        ref = reference(inputs, cap=cap, floor=floor, **kw)
        assert loss.item() == pytest.approx(ref["loss"], abs=1e-6)
        for key, value in ref.items():
            assert stats[key] == pytest.approx(value, abs=1e-6), key


def test_reference_cases_exercise_every_branch():
    """The random inputs really hit clipping, dual clipping, capping and flooring."""
    inputs = random_inputs(0, shape=(8, 64), spread=1.0)
    inputs["adv"][0] = -3.0
    inputs["lp"][0] = inputs["prox"][0] + 2.0  # r = e^2 > c_clip with A < 0
    _, stats = run(inputs, c_clip=3.0, behav_imp_weight_cap=2.0, behav_imp_weight_floor=0.5)
    ref = reference(inputs, eps_clip=0.2, eps_clip_higher=None, c_clip=3.0, behav_weight="segment", cap=2.0, floor=0.5)
    assert stats["clip_frac"] > 0.1 and stats["dual_clip_frac"] > 0.05 and stats["masked_frac"] > 0.1
    assert stats["loss"] == pytest.approx(ref["loss"], abs=1e-6)
    old = inputs["old"].reshape(-1)[inputs["mask"].reshape(-1).bool()]
    w = (inputs["prox_t"].reshape(-1)[inputs["mask"].reshape(-1).bool()] - old).exp()
    assert (w > 2.0).any() and (w < 0.5).any()


def test_global_token_mean_and_normalizer():
    """Micro-batches with the minibatch's token count as normalizer sum to the full-batch loss."""
    inputs = random_inputs(4, shape=(6, 11))
    full, _ = run(inputs)
    total = int(inputs["mask"].sum())
    parts = [{k: v[:2] for k, v in inputs.items()}, {k: v[2:] for k, v in inputs.items()}]
    summed = sum(run(p, loss_normalizer=total)[0] for p in parts)
    assert summed.item() == pytest.approx(full.item(), abs=1e-12)


def test_empty_mask_is_zero_not_nan():
    inputs = random_inputs(1)
    inputs["mask"].zero_()
    inputs["lp"] = inputs["lp"].clone().requires_grad_()
    loss, stats = run(inputs)
    loss.backward()
    assert loss.item() == 0.0 and stats["n_tokens"] == 0
    assert torch.all(inputs["lp"].grad == 0)


def test_huge_weights_and_padding_garbage_do_not_make_nan():
    inputs = random_inputs(2)
    inputs["prox_t"][0, 0] = 900.0  # exp overflows to inf -> capped out
    inputs["mask"][0, 0] = 1
    inputs["lp"][1, :] = float("inf")  # garbage on padding
    inputs["mask"][1, :] = 0
    inputs["lp"] = inputs["lp"].clone().requires_grad_()
    loss, stats = run(inputs)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(inputs["lp"].grad).all()
    assert stats["masked_frac"] > 0


def test_gradcheck_float64():
    inputs = random_inputs(5, shape=(2, 9))
    lp = inputs["lp"].clone().requires_grad_()

    def f(x):
        return run({**inputs, "lp": x}, c_clip=3.0)[0]

    assert torch.autograd.gradcheck(f, (lp,), eps=1e-7, atol=1e-6)


def test_gradient_matches_closed_form():
    """d loss / d logprob_i = -A_i * r_i * w_i / n on unclipped tokens, 0 on clipped or masked ones."""
    inputs = random_inputs(6, shape=(4, 13))
    lp = inputs["lp"].clone().requires_grad_()
    loss, _ = run({**inputs, "lp": lp}, c_clip=3.0)
    loss.backward()
    n = inputs["mask"].sum().item()
    for i, (a, l, p, o, t, m) in enumerate(
        zip(*(inputs[k].reshape(-1).tolist() for k in ("adv", "lp", "prox", "old", "prox_t", "mask")))
    ):
        r = math.exp(l - p)
        w = math.exp(t - o)
        rc = min(max(r, 0.8), 1.2)
        active = m and 0.2 <= w <= 5.0 and -a * r >= -a * rc and not (a < 0 and -a * r > 3.0 * abs(a))
        expected = -a * r * w / n if active else 0.0
        assert lp.grad.reshape(-1)[i].item() == pytest.approx(expected, abs=1e-9)


def test_proximal_t_only_changes_the_behaviour_weight():
    """Changing proximal_logprobs_t leaves the PPO ratio/clip part untouched: per-token gradients
    scale by exactly the ratio of the new to the old weight, and the ratio/clip stats are equal."""
    inputs = random_inputs(7, shape=(4, 16))
    changed = dict(inputs)
    g = torch.Generator().manual_seed(99)
    changed["prox_t"] = inputs["old"] + (torch.rand(inputs["old"].shape, generator=g, dtype=torch.float64) - 0.5) * 2

    grads, all_stats = [], []
    for inp in (inputs, changed):
        lp = inp["lp"].clone().requires_grad_()
        loss, stats = run({**inp, "lp": lp}, behav_imp_weight_cap=None, behav_imp_weight_floor=None, c_clip=3.0)
        loss.backward()
        grads.append(lp.grad)
        all_stats.append(stats)
    for key in ("clip_frac", "dual_clip_frac", "ratio_mean", "ratio_min", "ratio_max", "ratio_std"):
        assert all_stats[0][key] == all_stats[1][key], key
    w0 = (inputs["prox_t"] - inputs["old"]).exp()
    w1 = (changed["prox_t"] - changed["old"]).exp()
    assert torch.allclose(grads[0] / w0, grads[1] / w1, atol=1e-12)
    assert not torch.allclose(grads[0], grads[1])

    # with the weight off, proximal_logprobs_t has no effect whatsoever
    a, sa = run(inputs, behav_weight="off")
    b, sb = run(changed, behav_weight="off")
    assert a.item() == b.item() and stats_to_floats(sa) == stats_to_floats(sb)


def test_ratio_is_one_when_logprobs_equal_proximal():
    """The first minibatch of a step: logprobs == proximal -> nothing clipped, loss = -mean(A * w)."""
    inputs = random_inputs(8)
    inputs["lp"] = inputs["prox"].clone()
    loss, stats = run(inputs, behav_imp_weight_cap=None, behav_imp_weight_floor=None)
    m = inputs["mask"].bool()
    w = (inputs["prox_t"] - inputs["old"]).exp()
    assert stats["clip_frac"] == 0 and stats["ratio_min"] == stats["ratio_max"] == 1.0
    assert loss.item() == pytest.approx(-(inputs["adv"] * w)[m].sum().item() / m.sum().item(), abs=1e-12)


def test_shape_mismatch_and_bad_options_raise():
    inputs = random_inputs(9)
    with pytest.raises(ValueError, match="shape"):
        run({**inputs, "old": inputs["old"][:, :-1]})
    with pytest.raises(ValueError, match="behav_weight"):
        run(inputs, behav_weight="sometimes")
    with pytest.raises(ValueError, match="c_clip"):
        run(inputs, c_clip=0.5)


def test_float32_inputs_match_reference():
    inputs64 = random_inputs(10)
    inputs32 = {k: v.float() for k, v in inputs64.items()}
    loss, _ = run(inputs32, c_clip=3.0)
    ref = reference(
        {k: v.double() for k, v in inputs32.items()},
        eps_clip=0.2, eps_clip_higher=None, c_clip=3.0, behav_weight="segment", cap=5.0, floor=0.2,
    )
    assert loss.item() == pytest.approx(ref["loss"], abs=1e-5)
