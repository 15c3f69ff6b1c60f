"""The demo's task: "high digits", a two-turn chat graded from the digits the model sampled.

Turn 1 asks for five digits, each at least ``T`` (``T`` in 6..8, one per group, so GRPO
compares sessions that saw the same prompt). Turn 2 quotes the turn-1 answer and its score
back to the model and asks for five more; its prompt is the turn-1 prompt plus the sampled
turn-1 ids plus the new user message, which is what Splice splices.

Reward (0..1, dense, verifiable): per turn, an answer of exactly five characters earns 1/5 for
each digit ``>= T``; an answer of any other length earns 0 (otherwise writing four nines beats
five random digits and RL learns to stop early). The session's reward is the mean over its
two turns. Uniformly random five-digit answers score ``(10 - T) / 10``, 0.3 on average;
always writing ``99999`` scores 1.

Nothing here imports torch: the proxy side of the demo only builds texts and grades them.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

NAME = "high-digits"
N_DIGITS = 5
THRESHOLDS = (6, 7, 8)
DESCRIPTION = (
    "two-turn chat: 'Write 5 digits, each at least T' (T in 6..8 per group), then the answer and its "
    "score are quoted back and 5 more digits are asked for; per turn, an answer of exactly 5 characters "
    "earns 1/5 per digit >= T (any other length earns 0); reward = mean over the two turns"
)
# The tiny model's answer format, taught by the warm start: an empty think block, the digits, end of turn.
THINK = "<think>\n\n</think>\n\n"
IM_END = "<|im_end|>"


@dataclass(frozen=True)
class Prompt:
    """One group's task instance."""

    threshold: int

    def turn1(self) -> str:
        return f"Write {N_DIGITS} digits, each at least {self.threshold}."

    def turn2(self, first_answer: str) -> str:
        """The second user message: depends on what the model answered in turn 1."""
        shown = " ".join(first_answer.split()) or "nothing"
        hits = count_hits(first_answer, self.threshold)
        return (
            f"You wrote {shown[:40]}: {hits} of {N_DIGITS} at least {self.threshold}. "
            f"Write {N_DIGITS} more digits, each at least {self.threshold}."
        )


def sample_prompt(rng: random.Random) -> Prompt:
    return Prompt(threshold=rng.choice(THRESHOLDS))


def answer_text(text: str) -> str:
    """The graded part of a sampled turn: what follows the reasoning, without the end-of-turn token."""
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    elif "<think>" in text:  # reasoning never closed: no answer
        return ""
    return text.replace(IM_END, "").strip()


def count_hits(answer: str, threshold: int) -> int:
    """How many of the first ``N_DIGITS`` characters are digits ``>= threshold``."""
    return sum(1 for c in answer_text(answer)[:N_DIGITS] if c.isascii() and c.isdigit() and int(c) >= threshold)


def turn_score(answer: str, threshold: int) -> float:
    """Score of one sampled answer in [0, 1]: hits / 5 when it is exactly 5 characters, else 0."""
    text = answer_text(answer)
    return count_hits(text, threshold) / N_DIGITS if len(text) == N_DIGITS else 0.0


def session_reward(answers: list[str], threshold: int) -> float:
    """Mean turn score of a session's sampled answers (a turn that never happened scores 0)."""
    scores = [turn_score(a, threshold) for a in answers] + [0.0] * (2 - len(answers))
    return sum(scores) / len(scores)


def chance_reward() -> float:
    """Expected reward of uniformly random five-digit answers (the warm-started model's target)."""
    return sum((10 - t) / 10 for t in THRESHOLDS) / len(THRESHOLDS)


# -- warm start data (for the tiny CPU model only) --------------------------------------------------


def _chatml_user(text: str) -> str:
    return f"<|im_start|>user\n{text}{IM_END}\n<|im_start|>assistant\n"


def warm_start_pairs(n: int, seed: int) -> list[dict[str, str]]:
    """Prompt/completion pairs teaching the *format* only: uniformly random digits, never graded.

    Prompts are laid out as Splice builds them for the Qwen3 template: turn 1 is the rendered
    user message; turn 2 is turn 1's prompt + its verbatim completion (think block kept) + the
    bridge to the new user message. The completions ignore ``T``, so the warm-started model
    sits at chance on the reward and RL has everything left to learn.
    """
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = Prompt(rng.choice(THRESHOLDS))
        first = "".join(rng.choice("0123456789") for _ in range(N_DIGITS))
        second = "".join(rng.choice("0123456789") for _ in range(N_DIGITS))
        p1 = _chatml_user(prompt.turn1())
        c1 = THINK + first + IM_END
        if rng.random() < 0.5:
            out.append({"prompt": p1, "completion": c1})
        else:
            out.append({"prompt": p1 + c1 + "\n" + _chatml_user(prompt.turn2(first)), "completion": THINK + second + IM_END})
    return out


def write_warm_start(path: Path, n: int, seed: int) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in warm_start_pairs(n, seed)))
    return path
