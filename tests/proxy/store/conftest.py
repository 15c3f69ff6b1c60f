"""Shared fixtures for the store tests: a fresh store file and a turn factory."""

from __future__ import annotations

import pytest

from proxy.store.records import TurnRecord
from proxy.store import Store


def build_turn(
    session_id: str,
    index: int,
    prompt: list[int],
    output: list[int],
    *,
    version: int | list[int] = 0,
    logprobs: list[float] | None = None,
    turn_id: str | None = None,
    parent: str | None = None,
    created_at: float = 0.0,
) -> TurnRecord:
    """A finished turn with distinct per-token logprobs (so misplacements show) unless given."""
    n = len(output)
    versions = list(version) if isinstance(version, list) else [version] * n
    lps = logprobs if logprobs is not None else [-(index + 1) - (i + 1) / 1024 for i in range(n)]  # float32-exact
    return TurnRecord(
        turn_id=turn_id or f"{session_id}-t{index}",
        session_id=session_id,
        index=index,
        parent_turn_id=parent,
        prompt_ids=list(prompt),
        output_ids=list(output),
        output_logprobs=list(lps),
        versions=versions,
        proximal_logprobs_t=list(lps),
        proximal_versions=list(versions),
        spliced=index > 0,
        fork_reason=None,
        finish_reason="stop",
        created_at=created_at,
        requested_sampling={"temperature": 0.7},
        drift=False,
        api="responses",
        response_id=f"resp_{turn_id or f'{session_id}-t{index}'}",
    )


@pytest.fixture
def make_turn():
    return build_turn


class Clock:
    """A settable clock so lease expiry needs no sleeping."""

    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def db_path(tmp_path):
    return str(tmp_path / "splice.db")


@pytest.fixture
def store(db_path, clock):
    s = Store(db_path, clock=clock)
    yield s
    s.close()
