"""``splice demo``: the whole loop on one machine (see ``loop``)."""

from .loop import main

__all__ = ["main"]
