"""Stitching abort-resume segments into one ``Generation`` (docs/design.md section 4, rule R1).

Pure bookkeeping, no I/O, so every alignment rule is testable on its own:

- every segment's new tokens are stamped with the version that produced them;
- a resumed segment re-sends ``prompt + all accumulated output`` and asks for input logprobs
  from the *original* prompt length (so SGLang's ``logprob_start_len`` is always
  ``len(prompt) - 1``, never the previous segment's length);
- input logprobs are placed by absolute position: accumulated token ``i`` sits at position
  ``len(prompt) + i`` whatever the segment, and only tokens with ``versions[i] == V_new - 1``
  take the value (``proximal_versions[i] = V_new``);
- the token budget shrinks by what was already generated; an abort that leaves no budget ends
  the generation with ``"length"``;
- a resume re-sends every image of the prompt: the continuation is the prompt plus output,
  so the images' spans keep their offsets.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np

from engines.types import EngineImage, Generation, SamplingParams, Segment


def parse_version(value: str | None) -> int | None:
    """An engine-reported weight version as a non-negative int, or None (e.g. SGLang's "default")."""
    if value is None:
        return None
    try:
        v = int(str(value).strip())
    except ValueError:
        return None
    return v if v >= 0 else None


def token_versions(seg: Segment, fallback: int) -> tuple[list[int], int]:
    """(version of each new token, version the segment's prefill ran under).

    Engine-reported versions win over ``fallback`` (the pool's version when the call was sent):
    per-token spans when they cover every token and parse, else ``weight_version``.
    """
    n = len(seg.output_ids)
    whole = parse_version(seg.weight_version)
    seg_version = whole if whole is not None else fallback
    spans = seg.weight_version_spans
    if n and spans:
        parsed = [(s, e, parse_version(v)) for s, e, v in spans]
        per_token: list[int | None] = [None] * n
        for s, e, v in parsed:
            for i in range(max(s, 0), min(e, n)):
                per_token[i] = v
        if all(v is not None for v in per_token):
            return [v for v in per_token if v is not None], per_token[0]  # type: ignore[return-value]
    return [seg_version] * n, seg_version


@dataclass
class Stitcher:
    """Accumulates one request's segments; tells the caller what to send next."""

    prompt_ids: Sequence[int]  # a list or an int32 array (a spliced prompt); never mutated
    params: SamplingParams
    gen: Generation = field(default_factory=lambda: Generation(segments=0))
    # R2 on the next turn: the first segment also asks for the prompt's input logprobs from here
    prompt_logprobs_from: int | None = None
    # every image of the prompt (spans in prompt coordinates), sent with every segment
    images: tuple[EngineImage, ...] = ()

    @property
    def generated(self) -> int:
        return len(self.gen.output_ids)

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - self.generated

    def next_input_ids(self) -> Sequence[int]:
        """The prompt (as given: a list or an int32 array, not copied) followed by what was
        generated so far."""
        out = self.gen.output_ids
        if not out:
            return self.prompt_ids
        if isinstance(self.prompt_ids, np.ndarray):
            return np.concatenate((self.prompt_ids, np.asarray(out, dtype=self.prompt_ids.dtype)))
        return list(self.prompt_ids) + out

    def next_images(self) -> tuple[EngineImage, ...]:
        """The images the next call carries: all of the prompt's, at unchanged offsets (the
        output is appended after the prompt)."""
        return self.images

    def next_params(self) -> SamplingParams:
        return replace(self.params, max_new_tokens=max(self.remaining, 0))

    def logprobs_from(self, version: int) -> int | None:
        """``len(prompt)`` if an accumulated token is owed a proximal value under ``version``.

        Asking for input logprobs caps prefix caching, so it is only done when it pays.
        """
        g = self.gen
        owed = any(v == version - 1 and pv < version for v, pv in zip(g.versions, g.proximal_versions))
        frm = len(self.prompt_ids) if owed else None
        if g.segments == 0 and self.prompt_logprobs_from is not None:
            frm = self.prompt_logprobs_from if frm is None else min(frm, self.prompt_logprobs_from)
        return frm

    def add(self, seg: Segment, fallback_version: int) -> None:
        """Fold one engine call's result in (proximal updates first, then the new tokens)."""
        g = self.gen
        new_versions, prefill_version = token_versions(seg, fallback_version)
        if seg.input_logprobs and g.output_ids:
            base = len(self.prompt_ids) - seg.input_logprobs_start
            for i, v in enumerate(g.versions):
                j = base + i  # absolute position len(prompt) + i, relative to the reply's start
                if v != prefill_version - 1 or not 0 <= j < len(seg.input_logprobs):
                    continue
                value = seg.input_logprobs[j]
                if value is not None:
                    g.proximal_logprobs_t[i] = value
                    g.proximal_versions[i] = prefill_version
        if g.segments == 0 and self.prompt_logprobs_from is not None and seg.input_logprobs:
            self._take_prompt_logprobs(seg, prefill_version)
        if g.segments == 0:
            g.prompt_tokens = seg.prompt_tokens or len(self.prompt_ids)
            g.cached_tokens = seg.cached_tokens
        g.segments += 1
        g.output_ids.extend(seg.output_ids)
        g.logprobs.extend(seg.logprobs)
        g.versions.extend(new_versions)
        g.proximal_logprobs_t.extend(seg.logprobs)
        g.proximal_versions.extend(new_versions)
        g.finish_reason = seg.finish_reason
        g.matched_stop = seg.matched_stop
        if seg.finish_reason == "abort":
            g.aborts += 1

    def _take_prompt_logprobs(self, seg: Segment, prefill_version: int) -> None:
        """Keep the first segment's input logprobs of prompt positions [from, len(prompt))."""
        k = self.prompt_logprobs_from
        assert k is not None
        lo = k - seg.input_logprobs_start
        hi = len(self.prompt_ids) - seg.input_logprobs_start
        if lo < 0 or hi > len(seg.input_logprobs):
            return  # the engine answered for other positions: nothing placeable
        self.gen.prompt_logprobs = list(seg.input_logprobs[lo:hi])
        self.gen.prompt_logprobs_start = k
        self.gen.prompt_logprobs_version = prefill_version

    def settle(self) -> bool:
        """True when finished for good: stopped, hit the length limit, or aborted with no budget
        left (which is reported as ``"length"``). False: aborted, resume and continue."""
        if self.gen.finish_reason != "abort":
            return True
        if self.remaining <= 0:
            self.gen.finish_reason = "length"
            self.gen.matched_stop = None
            return True
        return False
