"""The sampling policy: what every engine call samples with, whatever the agent asked.

Logprobs are only comparable when they come from one distribution, so in ``trainable`` mode
(the default) every call samples at the server's temperature (1.0), top_p 1.0, top_k off; the
agent's values are recorded with the turn and counted. ``honor`` passes them through and
marks the turns not trainable.
"""

from __future__ import annotations

from engines.types import SamplingParams

from ..errors import APIError
from .turn import TurnRequest


class SamplingPolicy:
    FALLBACK_CONTEXT = 32768  # only when neither the flag nor the engine says

    def __init__(self, *, mode: str, temperature: float, max_context: int | None, default_max_tokens: int | None = None):
        self.mode = mode
        self.temperature = temperature
        self.max_context = max_context or self.FALLBACK_CONTEXT
        self._configured = max_context
        self.default_max_tokens = default_max_tokens  # --max-output-tokens: a cap on every turn; None: what fits

    def learn_context(self, engine_context: int | None) -> None:
        """The engine's context length bounds the flag; without a flag it is the limit."""
        if engine_context:
            self.max_context = min(self._configured, engine_context) if self._configured else engine_context

    def overridden(self, req: TurnRequest) -> bool:
        """Whether the agent asked for values this policy replaced (counted in /metrics)."""
        if self.mode == "honor":
            return False
        return req.temperature not in (None, self.temperature) or req.top_p not in (None, 1.0)

    def params(self, req: TurnRequest, prompt_len: int, stop_ids: tuple[int, ...]) -> SamplingParams:
        # One token of room stays free: the recompute prefill of a full turn re-reads it.
        room = self.max_context - prompt_len - 1
        if room <= 0:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_context} tokens; the prompt has "
                f"{prompt_len} tokens.",
                code="context_length_exceeded",
                param="input" if req.api == "responses" else "messages",
            )
        want = min(n for n in (req.max_output_tokens, self.default_max_tokens, room) if n)
        max_new = max(1, min(want, room))  # clamped to what fits (OpenAI's default: the rest of the context)
        if self.mode == "honor":
            return SamplingParams(
                max_new_tokens=max_new,
                temperature=req.temperature if req.temperature is not None else 1.0,
                top_p=req.top_p if req.top_p is not None else 1.0,
                stop=tuple(req.stop),
                stop_token_ids=stop_ids,
            )
        return SamplingParams(
            max_new_tokens=max_new, temperature=self.temperature, top_p=1.0, top_k=-1,
            stop=tuple(req.stop), stop_token_ids=stop_ids,
        )  # fmt: skip

    def used(self, req: TurnRequest) -> dict:
        """What the engine samples this turn with (top_k -1: off)."""
        if self.mode == "honor":
            return {"temperature": req.temperature if req.temperature is not None else 1.0,
                    "top_p": req.top_p if req.top_p is not None else 1.0, "top_k": -1}  # fmt: skip
        return {"temperature": self.temperature, "top_p": 1.0, "top_k": -1}

    def record(self, req: TurnRequest) -> dict:
        """What the agent asked, stored with the turn, and what the engine used (``used``)."""
        return {
            "used": self.used(req),
            "temperature": req.temperature,
            "top_p": req.top_p,
            "stop": list(req.stop),
            "max_output_tokens": req.max_output_tokens,
            "mode": self.mode,
            "trainable": self.mode == "trainable",
            "tools_not_offered": list(req.tools_not_offered),
            "controls_not_enforced": dict(req.controls_not_enforced),
        } | ({"history_edits": list(req.history_edits)} if req.history_edits else {})
