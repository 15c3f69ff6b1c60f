"""``splice bench``: benchmarks that print tables (``micro``: splice, store, logprobs; ``overhead``)."""

from .micro import main

__all__ = ["main"]
