"""Loss options for long off-policy samples, each against a float64 per-token reference written here.

Covers: the four ``loss_agg`` modes over packed samples, the per-token fallback to
``pi_prox / pi_behav`` where ``pi_{v+1}`` is missing, the engine-gap cap on fresh tokens, the
per-staleness behaviour-weight sums, ``proximal_logprobs=None`` (ratio identically 1), and
``proximal_logprobs_t=None`` where the weight does not use it.
"""

from __future__ import annotations

import math

import pytest
import torch

from trainer_bridge.loss import decoupled_ppo_loss, stats_to_floats

EPS, C_CLIP, CAP, FLOOR = 0.2, 3.0, 5.0, 0.2


def packed_inputs(seed: int, lengths=(5, 9, 1, 14, 7)) -> dict[str, torch.Tensor]:
    """One packed row of samples with their per-token fields (float64), version 10 is current."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    old = -torch.rand(n, generator=g, dtype=torch.float64) * 5
    seq = torch.cat([torch.full((k,), i) for i, k in enumerate(lengths)])
    mask = (torch.rand(n, generator=g) < 0.75).double()
    mask[seq == 2] = 0  # a sample with no loss token: not counted in any sample mean
    versions = torch.randint(6, 11, (n,), generator=g)
    missing = (torch.rand(n, generator=g) < 0.3) & (versions < 10)
    adv_per_seq = torch.randn(len(lengths), generator=g, dtype=torch.float64) * 2
    prox_t = old + (torch.rand(n, generator=g, dtype=torch.float64) - 0.5) * 2.4
    prox_t = torch.where(versions == 10, old, prox_t)  # pi_{v+1} of a fresh token does not exist yet
    return {
        "lp": old + (torch.rand(n, generator=g, dtype=torch.float64) - 0.5) * 1.2,
        "prox": old + (torch.rand(n, generator=g, dtype=torch.float64) - 0.5) * 2.4,
        "old": old,
        "prox_t": prox_t,
        "adv": adv_per_seq[seq],
        "mask": mask,
        "seq": seq,
        "versions": versions,
        "missing": missing,
        "fresh": versions == 10,
        "staleness": 10 - versions,
    }


def reference(x, *, agg="token-mean", norm_tokens=None, fallback=False, gap_cap=None, behav="segment",
              n_seqs=None, n_tok=None):
    """Token by token in Python floats."""
    L = x["lp"].numel()
    col = {k: x[k].tolist() for k in ("lp", "prox", "old", "prox_t", "adv", "mask", "seq", "missing", "fresh")}
    per_seq_tokens: dict[int, int] = {}
    for i in range(L):
        if col["mask"][i]:
            per_seq_tokens[col["seq"][i]] = per_seq_tokens.get(col["seq"][i], 0) + 1
    n_seqs = len(per_seq_tokens) if n_seqs is None else n_seqs
    n_tok = sum(per_seq_tokens.values()) if n_tok is None else n_tok
    total = 0.0
    w_by_stale: dict[int, list[float]] = {}
    for i in range(L):
        if not col["mask"][i]:
            continue
        a = col["adv"][i]
        r = math.exp(col["lp"][i] - col["prox"][i])
        pg = max(-a * r, -a * min(max(r, 1 - EPS), 1 + EPS))
        if a < 0 and pg > C_CLIP * abs(a):
            pg = C_CLIP * abs(a)
        if behav == "segment":
            use_prox = fallback and col["missing"][i]
            w = math.exp((col["prox"][i] if use_prox else col["prox_t"][i]) - col["old"][i])
        else:  # decoupled
            w = math.exp(col["prox"][i] - col["old"][i])
        if gap_cap is not None and col["fresh"][i]:
            w = min(math.exp(col["prox"][i] - col["old"][i]), gap_cap)
        w_by_stale.setdefault(int(x["staleness"][i]), []).append(w)
        if w > CAP or w < FLOOR:
            continue
        s = col["seq"][i]
        if agg == "token-mean":
            factor = 1 / n_tok
        elif agg == "seq-mean-token-sum":
            factor = 1 / n_seqs
        elif agg == "seq-mean-token-mean":
            factor = 1 / (n_seqs * per_seq_tokens[s])
        else:  # seq-mean-token-sum-norm
            factor = 1 / (n_seqs * norm_tokens)
        total += pg * w * factor
    return total, w_by_stale


def run(x, packed_1d=True, **kw):
    shape = (-1,) if packed_1d else (1, -1)
    t = {k: v.reshape(shape) for k, v in x.items()}
    return decoupled_ppo_loss(
        logprobs=t["lp"], proximal_logprobs=t["prox"], old_logprobs=t["old"], proximal_logprobs_t=t["prox_t"],
        advantages=t["adv"], loss_mask=t["mask"], seq_ids=t["seq"], c_clip=C_CLIP, eps_clip=EPS,
        behav_imp_weight_cap=CAP, behav_imp_weight_floor=FLOOR, **kw,
    )


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("packed_1d", [True, False])
def test_aggregations_match_reference(agg, packed_1d):
    for seed in range(4):
        x = packed_inputs(seed)
        norm = 64 if agg == "seq-mean-token-sum-norm" else None
        loss, _ = run(x, packed_1d, loss_agg=agg, loss_norm_tokens=norm)
        ref, _ = reference(x, agg=agg, norm_tokens=norm)
        assert loss.item() == pytest.approx(ref, abs=1e-12)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_split_over_micro_batches_sums_to_the_whole(agg):
    """Samples split over two calls, each given the minibatch-wide normaliser: the sum is the whole."""
    x = packed_inputs(7)
    norm = 32 if agg == "seq-mean-token-sum-norm" else None
    whole, _ = run(x, loss_agg=agg, loss_norm_tokens=norm)
    cut = int((x["seq"] <= 1).sum())  # samples 0, 1 | 2, 3, 4
    n_seqs = len({int(s) for s, m in zip(x["seq"], x["mask"]) if m})
    normalizer = int(x["mask"].sum()) if agg == "token-mean" else n_seqs
    parts = [{k: v[:cut] for k, v in x.items()}, {k: v[cut:] for k, v in x.items()}]
    total = sum(run(p, loss_agg=agg, loss_norm_tokens=norm, loss_normalizer=normalizer)[0] for p in parts)
    assert total.item() == pytest.approx(whole.item(), abs=1e-12)


def test_missing_proximal_fallback_matches_reference():
    for seed in range(4):
        x = packed_inputs(seed)
        assert (x["missing"] & x["mask"].bool()).any()
        loss, stats = run(x, proximal_missing=x["missing"])
        ref, _ = reference(x, fallback=True)
        assert loss.item() == pytest.approx(ref, abs=1e-12)
        without, _ = run(x)
        assert without.item() == pytest.approx(reference(x, fallback=False)[0], abs=1e-12)
        assert without.item() != pytest.approx(loss.item(), abs=1e-9)  # the fallback changes something
        m = x["mask"].bool()
        assert float(stats["missing_fallback_frac"]) == pytest.approx(float((x["missing"] & m).sum() / m.sum()))


def test_engine_gap_cap_truncates_fresh_tokens():
    for seed in range(4):
        x = packed_inputs(seed)
        gap = (x["prox"] - x["old"]).exp()
        assert ((gap > 1.3) & x["fresh"] & x["mask"].bool()).any()
        loss, stats = run(x, fresh=x["fresh"], engine_gap_cap=1.3)
        assert loss.item() == pytest.approx(reference(x, gap_cap=1.3)[0], abs=1e-12)
        assert float(stats["engine_gap_capped_frac"]) > 0


def test_behaviour_weight_by_staleness():
    x = packed_inputs(3)
    _, stats = run(x, proximal_missing=x["missing"], staleness=x["staleness"], staleness_buckets=4)
    _, ref = reference(x, fallback=True)
    values = stats_to_floats(stats)
    for k in range(4):
        ws = [w for s, group in ref.items() for w in group if min(s, 3) == k]  # the last bucket holds older ones
        assert values[f"tokens_by_staleness_{k}"] == len(ws)
        assert values[f"behav_imp_weight_sum_by_staleness_{k}"] == pytest.approx(sum(ws), abs=1e-12)
    assert sum(values[f"tokens_by_staleness_{k}"] for k in range(4)) == x["mask"].sum()


def test_no_proximal_means_ratio_one():
    x = packed_inputs(5)
    lp = x["lp"].clone().requires_grad_()
    loss, stats = decoupled_ppo_loss(logprobs=lp, old_logprobs=x["old"], proximal_logprobs_t=x["prox_t"],
                                     advantages=x["adv"], loss_mask=x["mask"])
    ref, _ = reference({**x, "prox": x["lp"]})  # prox == lp: every ratio is 1
    assert loss.item() == pytest.approx(ref, abs=1e-12)
    assert float(stats["ratio_min"]) == float(stats["ratio_max"]) == 1.0
    loss.backward()
    assert lp.grad.abs().sum() > 0  # still a gradient: d r / d logp = 1 at r = 1


def test_proximal_t_optional_unless_segment():
    x = packed_inputs(6)
    kw = dict(logprobs=x["lp"], proximal_logprobs=x["prox"], old_logprobs=x["old"], advantages=x["adv"],
              loss_mask=x["mask"], c_clip=C_CLIP)
    loss, _ = decoupled_ppo_loss(behav_weight="decoupled", **kw)
    assert loss.item() == pytest.approx(reference(x, behav="decoupled")[0], abs=1e-12)
    with pytest.raises(ValueError, match="proximal_logprobs_t"):
        decoupled_ppo_loss(behav_weight="segment", **kw)


def test_stats_stay_on_device_until_asked():
    x = packed_inputs(8)
    _, stats = run(x)
    assert all(isinstance(v, torch.Tensor) for v in stats.values())
    values = stats_to_floats(stats)
    assert isinstance(values["n_tokens"], int) and values["n_tokens"] == int(x["mask"].sum())


def test_bad_aggregation_options_raise():
    x = packed_inputs(9)
    with pytest.raises(ValueError, match="loss_agg"):
        run(x, loss_agg="sum")
    with pytest.raises(ValueError, match="loss_norm_tokens"):
        run(x, loss_agg="seq-mean-token-sum-norm")


def guard_reference(x, *, tis=None, band=None, behav="segment"):
    """Float64, token by token: the engine-trainer mismatch rho (fresh: prox - old; recomputed:
    prox - prox_t; else unknown), TIS multiplies min(rho, tis) into the weight in place of rho,
    MIS drops tokens whose rho leaves the band. Returns (loss, truncated, masked_by_band, tokens)."""
    col = {k: x[k].tolist() for k in ("lp", "prox", "old", "prox_t", "adv", "mask", "fresh", "recomputed")}
    n_tok = sum(1 for m in col["mask"] if m)
    total, truncated, banded = 0.0, 0, 0
    for i in range(len(col["lp"])):
        if not col["mask"][i]:
            continue
        a = col["adv"][i]
        r = math.exp(col["lp"][i] - col["prox"][i])
        pg = max(-a * r, -a * min(max(r, 1 - EPS), 1 + EPS))
        if a < 0 and pg > C_CLIP * abs(a):
            pg = C_CLIP * abs(a)
        if behav == "segment":
            w = math.exp(col["prox_t"][i] - col["old"][i])
        else:
            w = math.exp(col["prox"][i] - col["old"][i])
        rho = None
        if col["fresh"][i]:
            rho = math.exp(col["prox"][i] - col["old"][i])
        elif col["recomputed"][i]:
            rho = math.exp(col["prox"][i] - col["prox_t"][i])
        if rho is not None and tis is not None:
            truncated += rho > tis
            inner = rho if behav == "decoupled" else 1.0
            w = w / inner * min(rho, tis)
        if rho is not None and band is not None and not (band[0] <= rho <= band[1]):
            banded += 1
            continue
        if w > CAP or w < FLOOR:
            continue
        total += pg * w / n_tok
    return total, truncated, banded, n_tok


@pytest.mark.parametrize("behav", ["segment", "decoupled"])
@pytest.mark.parametrize("tis,band", [(2.0, None), (None, (0.5, 2.0)), (1.5, (0.6, 3.0))])
def test_off_policy_guards_match_float64_reference(behav, tis, band):
    """TIS and MIS on fresh and recomputed tokens, each against the float64 formula; the share of
    tokens each guard touched is reported."""
    for seed in range(5):
        x = packed_inputs(seed)
        g = torch.Generator().manual_seed(100 + seed)
        # tokens v-1 sampled whose pi_v the engine recomputed (their prox_t is under the trainer's weights)
        x["recomputed"] = (x["versions"] == 9) & (torch.rand(x["lp"].numel(), generator=g) < 0.8)
        loss, stats = run(x, fresh=x["fresh"], recomputed=x["recomputed"], tis_cap=tis, mis_band=band, behav_weight=behav)
        ref, truncated, banded, n_tok = guard_reference(x, tis=tis, band=band, behav=behav)
        assert loss.item() == pytest.approx(ref, abs=1e-12)
        s = stats_to_floats(stats)
        assert s["tis_truncated_frac"] == pytest.approx(truncated / n_tok)
        assert s["mis_masked_frac"] == pytest.approx(banded / n_tok)
        if tis is not None and band is None:
            assert truncated > 0  # the data exercises the guard
        if band is not None:
            assert banded > 0
        # and a guard changes the loss
        plain, _ = run(x, behav_weight=behav)
        assert plain.item() != pytest.approx(loss.item(), abs=1e-9)


def test_guards_leave_unmeasured_tokens_alone():
    """Without fresh / recomputed flags no token has a known mismatch: the guards change nothing."""
    x = packed_inputs(3)
    plain, _ = run(x)
    guarded, stats = run(x, tis_cap=1.01, mis_band=(0.99, 1.01))
    assert guarded.item() == pytest.approx(plain.item(), abs=1e-15)
    assert float(stats["mismatch_known_frac"]) == 0.0


def test_guard_arguments_are_checked():
    x = packed_inputs(0)
    with pytest.raises(ValueError, match="mis_band"):
        run(x, mis_band=(1.2, 3.0))
    with pytest.raises(ValueError, match="tis_cap"):
        run(x, tis_cap=0.0)
    with pytest.raises(ValueError, match="older name"):
        run(x, tis_cap=2.0, engine_gap_cap=3.0)
