"""The engine-trainer agreement gate: stop before training on a policy nobody trained.

Every step measures, on the loss tokens for which an engine gave a log-prob under the very
weights the trainer holds at the start of the step (tokens those weights sampled, and tokens
whose ``pi_{v+1}`` the engine recomputed under them), how far the trainer's own log-prob is from
the engine's: mean and max ``|gap|`` and NeMo-RL's ``token_mult_prob_error`` = mean of
``exp(|gap|)`` (1 when they agree exactly; NeMo-RL gates its CI on a median under 1.05-1.1).
Same weights, same tokens: a large value means the engine is not running the published policy,
and every later step would learn from samples of some other policy.

A step without such tokens measures nothing and neither trips nor clears the gate.
"""

from __future__ import annotations

from dataclasses import dataclass

#: What ``splice train`` exits with when the gate stops it.
EXIT_CODE = 3

LIKELY_CAUSES = (
    "a tied LM head on vLLM without Splice's worker extension (start vLLM with "
    "--worker-extension-cls engines.vllm_worker.SpliceWorkerExtension; docs/engines.md)",
    "the engine samples at another temperature / top-p / top-k than the trainer computes "
    "(splice serve --sampling, splice train --temperature)",
    "a dtype gap (engine in bfloat16 or float16 while the trainer runs float32, or the reverse: "
    "--save-dtype / --compute-dtype)",
    "the engine serves other weights than --model (a different checkpoint, a failed or skipped "
    "weight update, another model behind the same URL)",
)


class AgreementError(RuntimeError):
    """Raised on every rank when the gate trips; the message names the likely causes."""


@dataclass
class AgreementGate:
    """Counts consecutive measured steps whose ``token_mult_prob_error`` exceeds ``max_error``."""

    max_error: float | None = 1.1
    patience: int = 3
    strikes: int = 0

    @property
    def tripped(self) -> bool:
        return self.max_error is not None and self.strikes >= self.patience

    def check(self, stats: dict) -> dict:
        """Update from one step's stats; return the gate's fields for the step record
        (``agreement_stopped``: this step trips the gate, see :attr:`tripped`)."""
        error = stats.get("token_mult_prob_error")
        measured = error is not None and bool(stats.get("agreement_tokens"))
        if measured and self.max_error is not None:
            self.strikes = self.strikes + 1 if error > self.max_error else 0
        return {"agreement_measured": measured, "agreement_strikes": self.strikes, "agreement_stopped": self.tripped}

    def message(self, stats: dict) -> str:
        causes = "\n".join(f"  - {c}" for c in LIKELY_CAUSES)
        return (
            f"engine and trainer disagree on the same weights for {self.strikes} steps in a row: "
            f"token_mult_prob_error {stats.get('token_mult_prob_error'):.4g} > {self.max_error} "
            f"(mean |gap| {stats.get('agreement_abs_gap_mean', 0.0):.3g}, max |gap| "
            f"{stats.get('agreement_abs_gap_max', 0.0):.3g} nats over {stats.get('agreement_tokens', 0)} tokens). "
            "The engine is not sampling the policy being trained, so training stopped and this step's weights "
            "were not published (its samples stay in the proxy, unacked). Likely causes:\n"
            f"{causes}\n"
            "Raise --agreement-max-error (or 'none') only if the gap is understood."
        )
