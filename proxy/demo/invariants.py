"""Checks of docs/design.md sections 2-5 on recorded data; the demo exits non-zero when one fails."""

from __future__ import annotations

import math
from typing import Any


def check_session(session: dict[str, Any]) -> list[str]:
    """Problems in one ``GET /v1/sessions/{id}`` body (empty when all invariants hold)."""
    out: list[str] = []
    sid = session.get("session_id")
    turns = session.get("turns", [])
    by_id = {t["turn_id"]: t for t in turns}
    for t in turns:
        where = f"session {sid} turn {t['index']}"
        n = len(t["output_ids"])
        for key in ("output_logprobs", "versions", "proximal_logprobs_t", "proximal_versions"):
            if len(t[key]) != n:
                out.append(f"{where}: {key} has {len(t[key])} entries for {n} output tokens")
        if out:
            continue
        for i, (lp, v, plp, pv) in enumerate(zip(t["output_logprobs"], t["versions"], t["proximal_logprobs_t"], t["proximal_versions"])):
            if not (math.isfinite(lp) and lp <= 1e-4):
                out.append(f"{where} token {i}: behaviour logprob {lp} is not a log-probability")
            if v < 0:
                out.append(f"{where} token {i}: sampled token has version {v}")
            if pv not in (v, v + 1):
                out.append(f"{where} token {i}: proximal version {pv} is neither {v} nor {v + 1}")
            if pv == v and plp != lp:
                out.append(f"{where} token {i}: proximal value differs from behaviour without a recompute")
        if t["spliced"]:
            parent = by_id.get(t.get("parent_turn_id") or "")
            if parent is not None:
                prefix = parent["prompt_ids"] + parent["output_ids"]
                if t["prompt_ids"][: len(prefix)] != prefix:
                    out.append(f"{where}: spliced prompt does not start with the parent's prompt + output")
        elif t["index"] > 0 and not t.get("fork_reason") and any(m for m in turns[: t["index"]]):
            pass  # a fresh attempt in the same session (no assistant history) is not a fork
    return out


def check_sample(sample: dict[str, Any], turns: list[dict[str, Any]]) -> list[str]:
    """A pulled sample: aligned arrays, and every loss token is a recorded sampled token."""
    out: list[str] = []
    sid = sample.get("sample_id")
    n = len(sample["input_ids"])
    for key in ("loss_mask", "logprobs", "versions", "proximal_logprobs_t", "proximal_versions"):
        if len(sample[key]) != n:
            out.append(f"sample {sid}: {key} has {len(sample[key])} entries for {n} tokens")
    if out:
        return out
    for i in range(n):
        if sample["loss_mask"][i] == 0 and (sample["versions"][i] != -1 or sample["logprobs"][i] != 0.0):
            out.append(f"sample {sid} token {i}: unmasked-out token carries a version or logprob")
            break
    # Each turn's output must sit in the sample verbatim with its own logprobs (no off-by-one).
    ids = sample["input_ids"]
    for t in turns:
        o = t["output_ids"]
        if not o:
            continue
        start = len(t["prompt_ids"])
        if ids[start : start + len(o)] == o and all(sample["loss_mask"][start + j] == 1 for j in range(len(o))):
            if sample["logprobs"][start : start + len(o)] != t["output_logprobs"]:
                out.append(f"sample {sid}: turn {t['index']} logprobs are misaligned in the sample")
    return out


#: The agreement bound the demo holds its run to: the trainer's own gate default.
AGREEMENT_MAX_ERROR = 1.1


def agreement_problems(stats: list[dict[str, Any]], max_error: float = AGREEMENT_MAX_ERROR) -> list[str]:
    """Engine and trainer agree on the same weights: at least one step measured it, and every
    measured step's ``token_mult_prob_error`` (mean ``exp|gap|``) stays within ``max_error``."""
    measured = [(r["step"], r["token_mult_prob_error"]) for r in stats if r.get("token_mult_prob_error") is not None]
    if not measured:
        return ["no step measured engine-trainer agreement (no loss token had an engine log-prob under the trainer's weights)"]
    return [
        f"step {step}: engine and trainer disagree on the same weights (token_mult_prob_error {err:.4g} > {max_error})"
        for step, err in measured
        if err > max_error
    ]
