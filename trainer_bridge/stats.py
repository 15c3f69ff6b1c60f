"""Merge per-micro-batch stats into per-step stats.

A step is many micro-batches (and, under FSDP, many ranks). Each produces stats over its own
tokens; the step's numbers must be over *all* tokens, so stats are merged by token count:
means weighted, stds pooled (Chan's parallel formula), maxima/minima as such, sums summed.
The rule is picked from the key's suffix, so new stats need no registration.
"""

from __future__ import annotations

import math


def _rule(key: str) -> str:
    if key == "n_tokens" or key.endswith("_sum"):
        return "sum"
    if key.endswith("_max"):
        return "max"
    if key.endswith("_min"):
        return "min"
    if key.endswith("_std"):
        return "std"
    return "mean"


class StatsAccumulator:
    """Token-weighted merge of stat dicts that each carry ``n_tokens``."""

    def __init__(self) -> None:
        self.n = 0
        self._mean: dict[str, float] = {}
        self._m2: dict[str, float] = {}  # sum of squared deviations, for *_std keys
        self._other: dict[str, float] = {}

    def add(self, stats: dict[str, float]) -> None:
        n = int(stats.get("n_tokens", 0))
        if n == 0:
            return
        total = self.n + n
        means = {k: v for k, v in stats.items() if _rule(k) == "mean"}
        # stds first: they need the means from before this update
        for k, v in stats.items():
            if _rule(k) != "std":
                continue
            mk = k[: -len("_std")] + "_mean"
            new_mean = float(means.get(mk, 0.0))
            old_mean = self._mean.get(mk, new_mean)
            delta = new_mean - old_mean
            self._m2[k] = self._m2.get(k, 0.0) + float(v) ** 2 * n + delta**2 * self.n * n / total
        for k, v in means.items():
            old = self._mean.get(k, 0.0)
            self._mean[k] = old + (float(v) - old) * n / total
        for k, v in stats.items():
            rule = _rule(k)
            if k == "n_tokens" or rule in ("mean", "std"):
                continue
            if k not in self._other:
                self._other[k] = float(v)
            elif rule == "sum":
                self._other[k] += float(v)
            elif rule == "max":
                self._other[k] = max(self._other[k], float(v))
            elif rule == "min":
                self._other[k] = min(self._other[k], float(v))
        self.n = total

    def merge(self, other: "StatsAccumulator") -> None:
        """Fold in another accumulator (e.g. gathered from another rank)."""
        for part in other.parts():
            self.add(part)

    def parts(self) -> list[dict[str, float]]:
        """This accumulator as one stat dict (what :meth:`add` accepts)."""
        return [self.result()] if self.n else []

    def result(self) -> dict[str, float]:
        out: dict[str, float] = {"n_tokens": self.n}
        out.update(self._mean)
        out.update({k: math.sqrt(max(v, 0.0) / self.n) for k, v in self._m2.items()} if self.n else {})
        out.update(self._other)
        return out
