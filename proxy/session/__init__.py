"""The session layer: plan a turn (``planner``, pure), run it (``runner``), count the drift
splicing avoided (``drift``), keep proximal values current (``recompute``, R2)."""

from .planner import Plan, TurnLookup, plan
from .recompute import RecomputeScheduler
from .runner import TurnRunner, returned_message
from .turn import Presentation, TurnRequest, TurnResult

__all__ = [
    "Plan",
    "Presentation",
    "RecomputeScheduler",
    "TurnLookup",
    "TurnRequest",
    "TurnResult",
    "TurnRunner",
    "plan",
    "returned_message",
]
