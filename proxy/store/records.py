"""What the store keeps: one ``SessionRecord`` per agent session, one ``TurnRecord`` per finished turn.

Per-token arrays of a turn are in *output* coordinates: index ``i`` describes output token ``i``
(docs/design.md section 2). Sample assembly (``proxy.store.samples``) maps them into whole-sample coordinates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class SessionRecord:
    session_id: str
    group_id: str | None
    group_size: int | None
    reward: float | None
    closed: bool  # true once a reward was set; no more turns or rewards are accepted
    created_at: float
    metadata: dict = field(default_factory=dict)
    rewarded_at: float | None = None
    lease_id: str | None = None  # the trainer lease currently holding this session's samples
    acked: bool = False  # the trainer acknowledged its samples; they are never handed out again

    def to_dict(self) -> dict:
        return {
            "session_id": self.session_id,
            "group_id": self.group_id,
            "group_size": self.group_size,
            "reward": self.reward,
            "closed": self.closed,
            "created_at": self.created_at,
            "metadata": self.metadata,
            "rewarded_at": self.rewarded_at,
            "leased": self.lease_id is not None,
            "acked": self.acked,
        }


@dataclass
class TurnRecord:
    turn_id: str
    session_id: str
    index: int  # position of the turn in its session, 0-based
    parent_turn_id: str | None  # the turn this one continues (spliced onto or forked from)
    prompt_ids: list[int]  # (a turn being committed may carry its plan's int32 array instead)
    output_ids: list[int]
    output_logprobs: list[float]  # behaviour logprob of each output token
    versions: list[int]  # policy version that sampled each output token
    proximal_logprobs_t: list[float]  # log pi_{v+1} once recomputed, else == output_logprobs
    proximal_versions: list[int]  # version behind each proximal value (v+1 recomputed, v not yet)
    spliced: bool  # prompt built by splicing verbatim ids (False: full render, see fork_reason)
    fork_reason: str | None
    finish_reason: str
    created_at: float
    requested_sampling: dict  # what the agent asked for (temperature, top_p, ...), for the record
    drift: bool  # a full re-render would have produced different ids than the spliced prompt
    api: str  # "responses" or "chat"
    response_id: str
    abandoned: bool = False  # the client went away before it was delivered: never trained on
    images: tuple = ()  # ImageRef of every image in the prompt, in prompt order (proxy.store.images)
    role: str = "main"  # main | auxiliary | subagent | compacted (proxy.session.roles)

    @property
    def full_ids(self) -> list[int]:
        """Prompt followed by output: the token list a later spliced turn's prompt starts with."""
        prompt = self.prompt_ids
        return (prompt.tolist() if hasattr(prompt, "tolist") else list(prompt)) + list(self.output_ids)

    def check(self) -> None:
        """Raise ``ValueError`` if the per-token arrays disagree in length or hold non-finite logprobs."""
        n = len(self.output_ids)
        lens = {
            "output_logprobs": len(self.output_logprobs),
            "versions": len(self.versions),
            "proximal_logprobs_t": len(self.proximal_logprobs_t),
            "proximal_versions": len(self.proximal_versions),
        }
        bad = {k: v for k, v in lens.items() if v != n}
        if bad:
            raise ValueError(f"turn {self.turn_id}: per-token arrays must have {n} entries (output_ids), got {bad}")
        if self.index < 0:
            raise ValueError(f"turn {self.turn_id}: index must be >= 0, got {self.index}")
        for name in ("output_logprobs", "proximal_logprobs_t"):
            if not all(map(math.isfinite, getattr(self, name))):
                raise ValueError(f"turn {self.turn_id}: {name} holds a non-finite value")

    def to_dict(self) -> dict:
        """The ``GET /v1/sessions/{id}`` shape of one turn."""
        return {
            "turn_id": self.turn_id,
            "index": self.index,
            "parent_turn_id": self.parent_turn_id,
            "prompt_ids": self.prompt_ids,
            "output_ids": self.output_ids,
            "output_logprobs": self.output_logprobs,
            "versions": self.versions,
            "proximal_logprobs_t": self.proximal_logprobs_t,
            "proximal_versions": self.proximal_versions,
            "spliced": self.spliced,
            "fork_reason": self.fork_reason,
            "finish_reason": self.finish_reason,
            "created_at": self.created_at,
            "requested_sampling": self.requested_sampling,
            "drift": self.drift,
            "api": self.api,
            "response_id": self.response_id,
            "abandoned": self.abandoned,
            "images": [r.to_dict() for r in self.images],
            "role": self.role,
        }
