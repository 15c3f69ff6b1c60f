"""What every dialect reports about a finished turn: token counts, per-token logprobs, and the
``splice`` block (session, turn, spliced or forked and why)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenization import ChatFormat

from ..ids import header_value
from ..session.turn import TurnRequest, TurnResult


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    reasoning_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


def usage_of(fmt: ChatFormat, result: TurnResult, template_kwargs: dict | None = None) -> Usage:
    """Token counts; ``template_kwargs`` are the request's (they decide whether output starts in reasoning)."""
    gen = result.generation
    return Usage(
        prompt_tokens=len(result.prompt_ids) or gen.prompt_tokens,
        cached_tokens=gen.cached_tokens,
        output_tokens=len(gen.output_ids),
        reasoning_tokens=fmt.reasoning_token_count(gen.output_ids, template_kwargs=template_kwargs),
    )


def token_logprobs(fmt: ChatFormat, result: TurnResult) -> list[dict[str, Any]]:
    """Per-token logprobs of the whole sampled output (OpenAI's logprob entry shape)."""
    gen = result.generation
    ids = list(gen.output_ids)
    if not ids:
        return []
    lps = list(gen.logprobs) + [0.0] * max(0, len(ids) - len(gen.logprobs))
    return [
        {"token": b.decode("utf-8", errors="replace"), "logprob": float(lp), "bytes": list(b), "top_logprobs": []}
        for b, lp in zip(fmt.token_bytes(ids), lps)
    ]


def splice_info(result: TurnResult, req: TurnRequest | None = None) -> dict[str, Any]:
    """The ``splice`` extension block of every response: where the turn landed, and what the
    request sent that Splice did not act on (hosted tools not offered, controls not enforced)."""
    return {
        "session_id": result.session_id,
        "turn_id": result.turn_id,
        "spliced": result.spliced,
        "fork_reason": result.fork_reason,
        "finish_reason": result.finish_reason,
        "malformed_tool_calls": len(result.parsed.malformed_calls),
        "tools_not_offered": sorted(set(req.tools_not_offered)) if req is not None else [],
        "controls_not_enforced": sorted(req.controls_not_enforced) if req is not None else [],
        "history_edits": list(req.history_edits) if req is not None else [],  # continued under --history-edits keep
    }


def splice_headers(result: TurnResult) -> dict[str, str]:
    """``X-Splice-Session-Id`` / ``X-Splice-Turn-Id``: where a header-less client's turn landed."""
    return {"X-Splice-Session-Id": header_value(result.session_id), "X-Splice-Turn-Id": result.turn_id}
