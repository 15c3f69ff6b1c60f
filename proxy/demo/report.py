"""``summary.json`` for a demo run: per-step trainer numbers joined with what the proxy recorded.

Pure functions over plain data (trainer ``stats.jsonl`` records, ``GET /v1/sessions/{id}``
bodies, the demo's own session results), so they are testable without running anything.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Any

STEP_KEYS = (
    "reward_mean", "reward_std", "reward_min", "reward_max", "loss", "entropy_mean", "clip_frac",
    "behav_imp_weight_mean", "behav_imp_weight_std", "behav_imp_weight_max", "behav_kl_mean", "masked_frac",
    "engine_gap_mean", "engine_gap_abs_max", "engine_gap_tokens",
    "engine_prox_gap_mean", "engine_prox_gap_abs_max", "engine_prox_gap_tokens", "staleness_mean", "staleness_max",
    "n_sessions", "n_samples", "n_dropped_stale", "loss_tokens", "grad_norm", "train_time_s", "publish_time_s",
    "weight_transfer", "token_mult_prob_error", "agreement_tokens", "agreement_token_share", "agreement_abs_gap_mean",
    "agreement_abs_gap_max", "tis_truncated_frac", "mis_masked_frac",
)


def mean_std(xs: list[float]) -> tuple[float, float]:
    if not xs:
        return float("nan"), float("nan")
    m = sum(xs) / len(xs)
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def session_version(session: dict[str, Any]) -> int | None:
    """The policy version that sampled most of a session's tokens (None: no tokens)."""
    counts = Counter(v for t in session.get("turns", []) for v in t["versions"])
    return counts.most_common(1)[0][0] if counts else None


def spliced_share(sessions: list[dict[str, Any]]) -> float | None:
    later = [t for s in sessions for t in s.get("turns", []) if t["index"] > 0]
    return sum(bool(t["spliced"]) for t in later) / len(later) if later else None


def resumed_turns_by_update(sessions: list[dict[str, Any]]) -> dict[int, int]:
    """Per weight update to version ``v``: turns holding tokens of both ``v - 1`` and ``v``
    (the update landed while the turn was being generated; it was aborted and resumed)."""
    out: Counter[int] = Counter()
    for s in sessions:
        for t in s.get("turns", []):
            vs = set(t["versions"])
            for v in vs:
                if v - 1 in vs:
                    out[v] += 1
    return dict(out)


def metric(text: str, name: str, label: str | None = None) -> float:
    """Sum of a Prometheus counter/gauge over its label sets (optionally those matching ``label``)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        m = re.match(rf"{re.escape(name)}(?:_total)?(\{{[^}}]*\}})?\s+([-+0-9.eE]+|NaN|\+Inf)$", line)
        if m and (label is None or (m.group(1) and label in m.group(1))):
            total += float(m.group(2))
    return total


def build_summary(
    *,
    task: dict[str, Any],
    stats: list[dict[str, Any]],
    sessions: list[dict[str, Any]],
    rewards: dict[str, float],
    metrics_text: str = "",
    problems: list[str] | None = None,
    checked: dict[str, int] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The run's ``summary.json``.

    ``rewards`` maps session id -> the reward the demo computed (and posted) for it. The
    baseline is the reward of sessions sampled by version 0 (before any RL update).
    """
    by_id = {s["session_id"]: s for s in sessions}
    resumed = resumed_turns_by_update(sessions)
    steps = []
    for rec in stats:
        row: dict[str, Any] = {"step": rec["step"], "version": rec.get("version"), "trained_on_version": rec.get("trained_on_version")}
        row.update({k: rec[k] for k in STEP_KEYS if k in rec})
        ids = rec.get("session_ids") or []
        row["spliced_share"] = spliced_share([by_id[i] for i in ids if i in by_id])
        row["turns_resumed_across_update"] = resumed.get(int(rec.get("version") or 0), 0)
        steps.append(row)

    by_version: dict[int, list[float]] = {}
    for sid, r in rewards.items():
        v = session_version(by_id.get(sid, {}))
        if v is not None:
            by_version.setdefault(v, []).append(r)
    versions = []
    for v in sorted(by_version):
        m, sd = mean_std(by_version[v])
        versions.append({"version": v, "n_sessions": len(by_version[v]), "reward_mean": m, "reward_std": sd})
    base_m, base_sd = mean_std(by_version.get(0, []))
    baseline = {"version": 0, "n_sessions": len(by_version.get(0, [])), "reward_mean": base_m, "reward_std": base_sd}

    means = [s["reward_mean"] for s in steps if "reward_mean" in s]
    k = min(3, len(means) // 2) or 1
    first = sum(means[:k]) / k if means else float("nan")
    last = sum(means[-k:]) / k if means else float("nan")

    turns = [t for s in sessions for t in s.get("turns", [])]
    forks: Counter[str] = Counter()
    for s in sessions:
        forks.update(s.get("forks") or {})
    totals = {
        "sessions": len(sessions),
        "turns": len(turns),
        "later_turns": sum(t["index"] > 0 for t in turns),
        "spliced_later_turns": sum(bool(t["spliced"]) for t in turns if t["index"] > 0),
        "forks": dict(forks),
        "output_tokens": sum(len(t["output_ids"]) for t in turns),
        "turns_spanning_versions": sum(len(set(t["versions"])) > 1 for t in turns),
        "proximal_recomputed_tokens": sum(
            1 for t in turns for v, pv in zip(t["versions"], t["proximal_versions"]) if pv == v + 1
        ),
        "versions_seen": sorted({v for t in turns for v in t["versions"]}),
    }
    if metrics_text:
        totals.update(
            drift_avoided_turns=int(metric(metrics_text, "splice_drift_avoided")),
            aborts=int(metric(metrics_text, "splice_aborts")),
            resumes=int(metric(metrics_text, "splice_resumes")),
        )
    problems = list(problems or [])
    return {
        "task": task,
        "steps": steps,
        "baseline": baseline,
        "reward_by_version": versions,
        "reward_first3_mean": first,
        "reward_last3_mean": last,
        "reward_gain": last - first,
        "totals": totals,
        "weight_transfer": weight_transfer_summary(stats),
        "invariants": {"ok": not problems, "problems": problems[:200], "n_problems": len(problems), **(checked or {})},
        **(extra or {}),
    }


def weight_transfer_summary(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """How each step's weights reached the engines (``distributed``: broadcast over
    torch.distributed; ``disk``: the engines loaded the step directory) and the seconds each
    publish took (save included)."""
    secs = [float(r["publish_time_s"]) for r in stats if "publish_time_s" in r]
    return {
        "modes": sorted({str(r["weight_transfer"]) for r in stats if r.get("weight_transfer")}),
        "publish_s": [round(x, 4) for x in secs],
        "publish_s_mean": round(sum(secs) / len(secs), 4) if secs else None,
    }


def agreement_line(steps: list[dict[str, Any]]) -> str:
    """token_mult_prob_error over the steps that measured it (1 = exact), and the largest gap."""
    errs = [s["token_mult_prob_error"] for s in steps if s.get("token_mult_prob_error") is not None]
    if not errs:
        return "not measured"
    gap = max(float(s.get("agreement_abs_gap_max", 0.0)) for s in steps)
    return f"token_mult_prob_error max {max(errs):.5f} over {len(errs)}/{len(steps)} steps, max |gap| {gap:.1e} nats"


def table(summary: dict[str, Any]) -> str:
    """The summary as aligned text for the terminal."""
    t = summary["totals"]
    base = summary["baseline"]
    rows = [
        ("task", summary["task"]["name"]),
        ("sessions / turns", f"{t['sessions']} / {t['turns']}"),
        ("spliced share of later turns", f"{t['spliced_later_turns']}/{t['later_turns']}"),
        ("forks by reason", ", ".join(f"{k} {v}" for k, v in sorted(t["forks"].items())) or "none"),
        ("drift a re-render would cause (turns)", t.get("drift_avoided_turns", "n/a")),
        ("aborts / resumes", f"{t.get('aborts', 'n/a')} / {t.get('resumes', 'n/a')}"),
        ("turns spanning two versions", f"{t['turns_spanning_versions']} (a weight update landed mid-turn: aborted, resumed)"),
        ("engine-trainer agreement", agreement_line(summary["steps"])),
        ("proximal values recomputed (tokens)", t["proximal_recomputed_tokens"]),
        ("policy versions seen", f"{t['versions_seen'][0]}..{t['versions_seen'][-1]}" if t["versions_seen"] else "none"),
        ("baseline reward (v0 sessions)", f"{base['reward_mean']:.3f} ± {base['reward_std']:.3f} (n={base['n_sessions']})"),
    ]
    for s in summary["steps"]:
        rows.append((
            f"step {s['step']:>2}",
            f"reward {s.get('reward_mean', float('nan')):.3f}±{s.get('reward_std', float('nan')):.3f}"
            f"  w {s.get('behav_imp_weight_mean', float('nan')):.3f}/{s.get('behav_imp_weight_max', float('nan')):.2f}"
            f"  gap {s.get('agreement_abs_gap_max', s.get('engine_gap_abs_max', float('nan'))):.1e}"
            f"  stale {s.get('staleness_mean', float('nan')):.2f}"
            f"  ent {s.get('entropy_mean', float('nan')):.2f}",
        ))
    rows.append(("reward: first 3 steps -> last 3", f"{summary['reward_first3_mean']:.3f} -> {summary['reward_last3_mean']:.3f}"
                 f" ({summary['reward_gain']:+.3f})"))
    width = max(len(r[0]) for r in rows)
    rule = "=" * (width + 60)
    return "\n".join([rule, *(f"{k.ljust(width)}  {v}" for k, v in rows), rule])
