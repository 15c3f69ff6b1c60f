"""Turn a rewarded session's turns into training samples (docs/design.md section 5, longest active prefix).

Samples are assembled when the trainer pulls, from the stored turns, so proximal logprobs
recomputed after the turn finished are always the ones handed out. Pure functions, no I/O.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from .records import SessionRecord, TurnRecord

log = logging.getLogger(__name__)


@dataclass
class Sample:
    """One training sequence; every array has ``len(input_ids)`` entries (token coordinates)."""

    sample_id: str
    session_id: str
    group_id: str | None
    reward: float | None
    input_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    proximal_logprobs_t: list[float] = field(default_factory=list)
    proximal_versions: list[int] = field(default_factory=list)
    turn_ids: list[str] = field(default_factory=list)  # the turns merged into this sample, in order
    # False when a turn was sampled with the agent's own settings (``--sampling honor``): its
    # behaviour logprobs come from another distribution than the trainer's.
    trainable: bool = True

    def __len__(self) -> int:
        return len(self.input_ids)

    def _append_context(self, ids: list[int]) -> None:
        """Tokens the policy did not sample (prompt, tool output, chat template): not trained on."""
        n = len(ids)
        self.input_ids.extend(ids)
        self.loss_mask.extend([0] * n)
        self.logprobs.extend([0.0] * n)
        self.versions.extend([-1] * n)
        self.proximal_logprobs_t.extend([0.0] * n)
        self.proximal_versions.extend([-1] * n)

    def _append_output(self, turn: TurnRecord) -> None:
        self.input_ids.extend(turn.output_ids)
        self.loss_mask.extend([1] * len(turn.output_ids))
        self.logprobs.extend(turn.output_logprobs)
        self.versions.extend(turn.versions)
        self.proximal_logprobs_t.extend(turn.proximal_logprobs_t)
        self.proximal_versions.extend(turn.proximal_versions)
        self.turn_ids.append(turn.turn_id)
        if (turn.requested_sampling or {}).get("trainable") is False:
            self.trainable = False

    def to_dict(self) -> dict:
        """The wire shape of ``POST /v1/trajectories/pull`` samples."""
        return {
            "sample_id": self.sample_id,
            "session_id": self.session_id,
            "group_id": self.group_id,
            "reward": self.reward,
            "input_ids": self.input_ids,
            "loss_mask": self.loss_mask,
            "logprobs": self.logprobs,
            "versions": self.versions,
            "proximal_logprobs_t": self.proximal_logprobs_t,
            "proximal_versions": self.proximal_versions,
            "turn_ids": self.turn_ids,
            "trainable": self.trainable,
        }


def _longest(matches: list[Sample]) -> Sample:
    return max(matches, key=len)  # equal lengths are identical token lists: the oldest wins


_choose = _longest  # the rule, named so a test can prove the first-match rule would fail


def assemble_samples(session: SessionRecord, turns: list[TurnRecord]) -> list[Sample]:
    """Merge turns into prefix-stable samples.

    Turns are taken in index order. A turn whose prompt starts with an existing sample's full
    token list extends that sample (new prompt tokens masked out, output tokens trained on);
    when several samples match, the longest wins, because a shorter match is a stale prefix
    of a later rollback branch (seed 002) and extending it would file sampled tokens as prompt.
    Otherwise the turn starts a new sample; earlier samples are never modified by a fork.
    """
    samples: list[Sample] = []
    for turn in sorted(turns, key=lambda t: t.index):
        if turn.abandoned:  # never delivered to its client: not a trajectory anyone acted on
            continue
        turn.check()
        prompt = turn.prompt_ids
        matches = [s for s in samples if len(s) <= len(prompt) and prompt[: len(s)] == s.input_ids]
        if len(matches) > 1:
            log.warning(
                "ambiguous prefix match in session %s turn %d (%s): %d of %d samples match "
                "(lens=%s, prompt_len=%d); extending the longest",
                session.session_id,
                turn.index,
                turn.turn_id,
                len(matches),
                len(samples),
                sorted(len(s) for s in matches),
                len(prompt),
            )
        if matches:
            target = _choose(matches)
            target._append_context(prompt[len(target) :])
        else:
            target = Sample(
                sample_id=f"{session.session_id}:{len(samples)}",
                session_id=session.session_id,
                group_id=session.group_id,
                reward=session.reward,
            )
            target._append_context(prompt)
            samples.append(target)
        target._append_output(turn)
    return samples
