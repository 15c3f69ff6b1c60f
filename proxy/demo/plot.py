"""The demo's plot: learning and off-policy health per training step, from ``summary.json``."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def _vals(steps: list[dict[str, Any]], key: str) -> list[float]:
    out = []
    for s in steps:
        v = s.get(key)
        out.append(float(v) if isinstance(v, (int, float)) and v is not None else math.nan)
    return out


def plot_summary(summary: dict[str, Any], path: str | Path) -> Path:
    """Write a 2x3 panel PNG: reward vs baseline, entropy, importance weights, trainer/engine gap,
    staleness, and weight updates landing mid-generation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = summary["steps"]
    x = [s["step"] for s in steps]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.2))
    (ax_r, ax_e, ax_w), (ax_g, ax_s, ax_u) = axes

    # (a) reward per step vs the untrained policy
    mean, std = _vals(steps, "reward_mean"), _vals(steps, "reward_std")
    ax_r.fill_between(x, [max(0.0, m - s) for m, s in zip(mean, std)], [min(1.0, m + s) for m, s in zip(mean, std)], alpha=0.2, color="C0",
                      label="± std over the step's sessions")
    ax_r.plot(x, mean, marker="o", color="C0", label="trainer batch mean")
    base = summary.get("baseline") or {}
    if base.get("n_sessions"):
        ax_r.axhline(base["reward_mean"], color="C3", ls="--",
                     label=f"untrained (v0) sessions: {base['reward_mean']:.2f} (n={base['n_sessions']})")
    chance = (summary.get("task") or {}).get("chance_reward")
    if chance is not None:
        ax_r.axhline(chance, color="grey", ls=":", lw=1, label=f"uniformly random digits: {chance:.2f}")
    ax_r.set_ylim(-0.02, 1.02)
    ax_r.set_title("Reward from the sampled text (0-1)")
    ax_r.set_ylabel("session reward")
    ax_r.legend(fontsize=7.5, loc="lower right")

    # (b) entropy of the sampled tokens under the trainer's policy
    ax_e.plot(x, _vals(steps, "entropy_mean"), marker="o", color="C2")
    ax_e.set_title("Policy entropy on sampled tokens")
    ax_e.set_ylabel("nats / token")

    # (c) behaviour importance weights w = pi_{v+1} / pi_v (segment-wise)
    wm, ws, wx = _vals(steps, "behav_imp_weight_mean"), _vals(steps, "behav_imp_weight_std"), _vals(steps, "behav_imp_weight_max")
    ax_w.fill_between(x, [m - s for m, s in zip(wm, ws)], [m + s for m, s in zip(wm, ws)], alpha=0.2, color="C1")
    ax_w.plot(x, wm, marker="o", color="C1", label="mean ± std")
    ax_w.plot(x, wx, marker="^", ls="--", color="C1", alpha=0.7, label="max")
    ax_w.axhline(1.0, color="grey", lw=0.8)
    masked = _vals(steps, "masked_frac")
    if any(m > 0 for m in masked if not math.isnan(m)):
        tw = ax_w.twinx()
        tw.bar(x, masked, alpha=0.15, color="C7", width=0.6)
        tw.set_ylabel("share masked (w outside [0.2, 5])", fontsize=8)
    ax_w.set_title("Behaviour weight  w = π_{v+1}/π_v  (loss tokens)")
    ax_w.set_ylabel("w")
    ax_w.legend(fontsize=7.5, loc="upper left")

    # (d) trainer vs engine log-probs under the same weights (the version the trainer holds)
    def series(key: str, n_key: str) -> tuple[list[float], list[float]]:
        pts = [(a, abs(v)) for a, v, n in zip(x, _vals(steps, key), _vals(steps, n_key)) if n and not math.isnan(n) and v != 0]
        return [a for a, _ in pts], [v for _, v in pts]

    for key, n_key, label, style in (
        ("engine_gap_abs_max", "engine_gap_tokens", "behaviour logprob, tokens v_k sampled: max", dict(marker="o", color="C4")),
        ("engine_prox_gap_abs_max", "engine_prox_gap_tokens", "recomputed π_{v+1}, tokens v_k−1 sampled: max",
         dict(marker="s", color="C9")),
        ("engine_prox_gap_mean", "engine_prox_gap_tokens", "recomputed π_{v+1}: |mean|", dict(marker="s", color="C9", ls=":", alpha=0.6)),
    ):
        gx, gy = series(key, n_key)
        if gx:
            ax_g.plot(gx, gy, label=label, **style)
    ax_g.set_yscale("log")
    ax_g.set_title("Trainer vs engine log π, same weights v_k")
    ax_g.set_ylabel("|log π_trainer − log π_engine|")
    ax_g.legend(fontsize=7.5)

    # (e) staleness of the trained tokens
    stale_max = _vals(steps, "staleness_max")
    ax_s.bar(x, _vals(steps, "staleness_mean"), color="C5", alpha=0.7, label="mean")
    ax_s.plot(x, stale_max, marker="_", ms=14, ls="none", color="k", label="max")
    ax_s.set_ylim(0, max([v for v in stale_max if not math.isnan(v)] or [1]) + 0.7)
    ax_s.set_title("Staleness of trained tokens")
    ax_s.set_ylabel("versions behind the trainer")
    ax_s.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax_s.legend(fontsize=7.5, loc="upper center", ncol=2)

    # (f) weight updates landing while turns were being generated
    ax_u.bar(x, _vals(steps, "turns_resumed_across_update"), color="C6", alpha=0.8)
    ax_u.set_title("Update after step k landed mid-generation")
    ax_u.set_ylabel("turns aborted + resumed across it")
    ax_u.yaxis.set_major_locator(MaxNLocator(integer=True))

    for ax in axes.flat:
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    task = summary.get("task") or {}
    fig.suptitle(
        f"splice demo · task {task.get('name', '?')} (reward graded from sampled text) · seed {summary.get('seed', '?')} · "
        f"reward first 3 steps {summary['reward_first3_mean']:.2f} → last 3 {summary['reward_last3_mean']:.2f}",
        fontsize=12,
    )
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
