"""The role of each call of an episode, decided when its turn is planned (proxy.session.roles).

Reads at most two small rows per turn (the parent's role, and the episode's main facts on a
cache miss), never token arrays; the main facts of recent sessions are kept in memory.
"""

from __future__ import annotations

from collections import OrderedDict

from ..store import Store
from .planner import Plan
from .roles import STRUCTURED_CONTROLS, EpisodeFacts, classify, facts_of
from .turn import TurnRequest

_CACHE = 65536


class EpisodeRoles:
    def __init__(self, store: Store):
        self.store = store
        self._main: OrderedDict[str, EpisodeFacts] = OrderedDict()

    def main_facts(self, session_id: str) -> EpisodeFacts | None:
        hit = self._main.get(session_id)
        if hit is not None:
            self._main.move_to_end(session_id)
            return hit
        row = self.store.turns.first_of_role(session_id, "main")
        facts = None
        if row is not None and isinstance(ep := row[1].get("episode"), dict):
            facts = EpisodeFacts(str(ep.get("system", "")), int(ep.get("tools", 0)), str(ep.get("model", "")))
            self._remember(session_id, facts)
        return facts

    def _remember(self, session_id: str, facts: EpisodeFacts) -> None:
        self._main[session_id] = facts
        self._main.move_to_end(session_id)
        while len(self._main) > _CACHE:
            self._main.popitem(last=False)

    def assign(self, req: TurnRequest, p: Plan, new_session: bool) -> None:
        """Set ``req.role`` / ``req.role_reason`` for the planned turn."""
        main = None if new_session else self.main_facts(p.session_id)
        parent_role = self.store.turns.role_of(p.parent_turn_id) if p.parent_turn_id else None
        structured = any(req.controls_not_enforced.get(k) for k in STRUCTURED_CONTROLS)
        req.role, req.role_reason = classify(
            req.messages, req.tools, req.model, declared=req.role, structured=structured, compaction=req.compaction,
            parent_role=parent_role, main=main,
        )  # fmt: skip
        if req.role == "main" and (main is None or (not main.tools and req.tools)):
            # the episode's main conversation is its first main call that offers tools (else its first)
            self._remember(p.session_id, facts_of(req.messages, req.tools, req.model))

    def record(self, req: TurnRequest, p: Plan) -> dict:
        """What goes into the turn's ``requested_sampling`` about its role."""
        f = facts_of(req.messages, req.tools, req.model)
        rec = {"role_reason": req.role_reason, "episode": {"system": f.system, "tools": f.tools, "model": f.model}}
        if req.compaction:
            rec["compaction"] = req.compaction
        if p.summary_ids:
            rec["summary_ids"] = p.summary_ids
        return rec
