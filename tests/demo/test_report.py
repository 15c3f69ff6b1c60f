"""summary.json and the plot, from synthetic run data (nothing is started)."""

from __future__ import annotations

import json
import math

import pytest

from proxy.demo.progress import Progress, bar
from proxy.demo.report import build_summary, resumed_turns_by_update, session_version, spliced_share, table


def _turn(index, versions, spliced=True):
    n = len(versions)
    return {"index": index, "turn_id": f"t{index}", "prompt_ids": [1, 2], "output_ids": list(range(n)),
            "output_logprobs": [-1.0] * n, "versions": versions, "proximal_logprobs_t": [-1.0] * n,
            "proximal_versions": [v + 1 for v in versions], "spliced": spliced}


def _session(sid, versions1, versions2, spliced=True):
    return {"session_id": sid, "turns": [_turn(0, versions1, False), _turn(1, versions2, spliced)], "forks": {}}


def _stats(n_steps):
    out = []
    for k in range(1, n_steps + 1):
        out.append({"step": k, "version": k, "trained_on_version": k - 1, "reward_mean": 0.3 + 0.05 * k,
                    "reward_std": 0.1, "loss": 0.01 * (-1) ** k, "behav_imp_weight_mean": 1 + 0.01 * k,
                    "behav_imp_weight_std": 0.05, "behav_imp_weight_max": 1.5 + 0.1 * k, "masked_frac": 0.01 * (k % 2),
                    "engine_gap_abs_max": 1e-5 * k, "engine_gap_mean": -1e-6, "engine_gap_tokens": 10 * (k % 2),
                    "engine_prox_gap_abs_max": 2e-5, "engine_prox_gap_mean": 1e-6, "engine_prox_gap_tokens": 30,
                    "staleness_mean": 0.5 + 0.05 * k, "staleness_max": 1 + k % 2, "entropy_mean": 1.1 - 0.05 * k,
                    "session_ids": [f"s{k}a", f"s{k}b"]})
    return out


def test_summary_joins_trainer_steps_with_recorded_sessions():
    stats = _stats(8)
    sessions, rewards = [], {}
    for k in range(1, 9):
        sessions.append(_session(f"s{k}a", [k - 1] * 4, [k - 1, k - 1, k, k]))  # update k landed mid-turn
        sessions.append(_session(f"s{k}b", [k - 1] * 4, [k - 1] * 3, spliced=k % 2 == 0))
        rewards[f"s{k}a"], rewards[f"s{k}b"] = 0.2 + 0.05 * k, 0.4 + 0.05 * k
    metrics = "# HELP x\nsplice_aborts_total 7.0\nsplice_resumes_total 6.0\nsplice_drift_avoided_total 16.0\n"
    summary = build_summary(task={"name": "t", "chance_reward": 0.3}, stats=stats, sessions=sessions, rewards=rewards,
                            metrics_text=metrics, problems=[], checked={"sessions_checked": 16}, extra={"seed": 3})
    json.dumps(summary)  # serializable
    assert [s["step"] for s in summary["steps"]] == list(range(1, 9))
    first = summary["steps"][0]
    for key in ("reward_mean", "reward_std", "loss", "behav_imp_weight_mean", "behav_imp_weight_max",
                "engine_gap_abs_max", "staleness_mean", "spliced_share"):
        assert key in first
    assert [s["spliced_share"] for s in summary["steps"][:2]] == [0.5, 1.0]
    assert all(s["turns_resumed_across_update"] == 1 for s in summary["steps"])
    assert summary["baseline"]["n_sessions"] == 2 and summary["baseline"]["reward_mean"] == pytest.approx(0.35)
    assert summary["reward_first3_mean"] == pytest.approx(0.4)
    assert summary["reward_last3_mean"] == pytest.approx(0.3 + 0.05 * 7)
    assert summary["totals"]["aborts"] == 7 and summary["totals"]["drift_avoided_turns"] == 16
    assert summary["totals"]["turns_spanning_versions"] == 8
    assert summary["invariants"] == {"ok": True, "problems": [], "n_problems": 0, "sessions_checked": 16}
    assert "step  8" in table(summary)

    bad = build_summary(task={"name": "t"}, stats=stats, sessions=sessions, rewards=rewards, problems=["x"])
    assert bad["invariants"]["ok"] is False and bad["invariants"]["n_problems"] == 1


def test_helpers():
    s = _session("a", [0, 0, 1], [1, 1, 1, 2])
    assert session_version(s) == 1
    assert resumed_turns_by_update([s]) == {1: 1, 2: 1}
    assert spliced_share([s]) == 1.0 and spliced_share([]) is None
    assert bar(5, 10, 10) == "#####....."


def test_plot_has_labelled_non_constant_panels(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.figure

    from proxy.demo import plot as plot_mod

    stats = _stats(10)
    sessions = [_session(f"s{k}{j}", [k - 1] * 3, [k - 1, k]) for k in range(1, 11) for j in range(1 + k % 3)]
    summary = build_summary(task={"name": "t", "chance_reward": 0.3}, stats=stats, sessions=sessions,
                            rewards={f"s{k}a": 0.1 * k for k in range(1, 11)}, extra={"seed": 0})
    captured = {}
    real_savefig = matplotlib.figure.Figure.savefig

    def spy(fig, *a, **kw):
        captured["fig"] = fig
        return real_savefig(fig, *a, **kw)

    matplotlib.figure.Figure.savefig = spy
    try:
        out = plot_mod.plot_summary(summary, tmp_path / "p.png")
    finally:
        matplotlib.figure.Figure.savefig = real_savefig
    assert out.stat().st_size > 20_000
    axes = [ax for ax in captured["fig"].axes if ax.get_title()]
    assert len(axes) == 6
    for ax in axes:
        assert ax.get_xlabel() and ax.get_ylabel(), ax.get_title()
        ys = [y for line in ax.get_lines() for y in line.get_ydata() if not math.isnan(y)]
        ys += [p.get_height() for p in ax.patches]
        assert len(set(round(y, 12) for y in ys)) > 1, f"constant panel: {ax.get_title()}"


def test_progress_lines_are_plain_when_not_a_terminal(tmp_path):
    path = tmp_path / "out.txt"
    with open(path, "w") as f:
        p = Progress(stream=f)
        p.live("invisible")
        p.phase("engine", "up")
    text = path.read_text()
    assert "invisible" not in text and "engine   up" in text and text.startswith("[")
