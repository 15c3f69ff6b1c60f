"""The pure planner against an in-memory lookup and the real Qwen3 chat format: every fork
reason, the splice itself, and the choice among several matching turns (header-less GRPO
sessions whose answers coincide)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from proxy.session.planner import PlanOffLoop, answer_fingerprints, digest, fingerprint_keys, plan
from proxy.session.turn import TurnRequest
from tokenization import ChatFormat, Message, Tool, load_tokenizer, qwen3_tokenizer_dir


@dataclass
class Cand:
    turn_id: str
    session_id: str
    continued: bool = False
    variant: bytes | None = None


@dataclass
class MemoryLookup:
    """Recorded turns in dicts; ``record`` stores what the runner's commit would."""

    fps: dict[bytes, list[Cand]] = field(default_factory=dict)
    ids: dict[str, tuple[list[int], list[int]]] = field(default_factory=dict)
    sessions: dict[str, str] = field(default_factory=dict)  # turn -> session
    claims: set[str] = field(default_factory=set)

    def candidates(self, fingerprint, variant=None):
        return list(reversed(self.fps.get(fingerprint, [])))  # most recent first (the planner sorts by variant)

    def turn_ids(self, turn_id):
        return self.ids.get(turn_id)

    def session_of(self, turn_id):
        return self.sessions.get(turn_id)

    def session_exists(self, session_id):
        return session_id in self.sessions.values()

    def claimed(self, turn_id):
        return turn_id in self.claims

    def record(self, req: TurnRequest, p, turn_id: str, answer: Message, output_ids: list[int]) -> None:
        for c in (c for cands in self.fps.values() for c in cands if c.turn_id == p.parent_turn_id):
            c.continued = True
        hashed = p.history_hash.copy().extend(req.messages[p.hashed :])
        for fp, variant in answer_fingerprints(hashed, req, answer, p.session_id):
            self.fps.setdefault(fp, []).append(Cand(turn_id, p.session_id, variant=variant))
        self.ids[turn_id] = (p.prompt_ids, output_ids)
        self.sessions[turn_id] = p.session_id


@pytest.fixture(scope="module")
def fmt():
    return ChatFormat(load_tokenizer(str(qwen3_tokenizer_dir())), "qwen3")


TOOL = Tool(name="add", description="Add two integers.", parameters={"type": "object", "properties": {"a": {"type": "integer"}}})
USER = Message("user", "What is 1+2?")
ANSWER = Message("assistant", "The answer is 3.")


def _req(messages, *, session=None, tools=(), kwargs=None, hint=None) -> TurnRequest:
    return TurnRequest(api="chat", messages=list(messages), turn_id="t", tools=list(tools), session_id=session,
                       chat_template_kwargs=kwargs, parent_hint=hint)  # fmt: skip


def _first_turn(fmt, lookup, *, session=None, tools=(), kwargs=None, turn_id="t0"):
    req = _req([USER], session=session, tools=tools, kwargs=kwargs)
    p = plan(req, lookup, fmt)
    out = fmt.tokenizer.encode("The answer is 3.<|im_end|>", add_special_tokens=False)
    lookup.record(req, p, turn_id, ANSWER, out)
    return p, out


def test_first_turn_is_a_full_render_without_a_reason(fmt):
    p = plan(_req([USER]), MemoryLookup(), fmt)
    assert not p.spliced and p.fork_reason is None and p.parent_turn_id is None and p.new_session
    assert p.prompt_ids.dtype == np.int32 and p.prompt_ids.tolist() == fmt.render([USER])


def test_continuation_is_spliced_from_the_recorded_ids(fmt):
    lookup = MemoryLookup()
    p0, out0 = _first_turn(fmt, lookup)
    p1 = plan(_req([USER, ANSWER, Message("user", "Sure?")]), lookup, fmt)
    assert p1.spliced and p1.fork_reason is None and p1.parent_turn_id == "t0"
    assert p1.session_id == p0.session_id
    assert p1.prompt_ids.dtype == np.int32
    assert p1.prompt_ids[: len(p0.prompt_ids) + len(out0)].tolist() == p0.prompt_ids.tolist() + out0


def test_unknown_parent(fmt):
    lookup = MemoryLookup()
    _first_turn(fmt, lookup)
    p = plan(_req([USER, Message("assistant", "Something else."), Message("user", "?")]), lookup, fmt)
    assert (p.spliced, p.fork_reason, p.parent_turn_id) == (False, "unknown_parent", None)


def test_history_edited_by_hint_and_by_session(fmt):
    lookup = MemoryLookup()
    p0, _ = _first_turn(fmt, lookup, session="s1")
    edited = [USER, Message("assistant", "The answer is 4."), Message("user", "?")]
    by_hint = plan(_req(edited, hint="t0"), lookup, fmt)
    assert (by_hint.fork_reason, by_hint.parent_turn_id, by_hint.session_id) == ("history_edited", "t0", "s1")
    by_session = plan(_req(edited, session="s1"), lookup, fmt)
    assert (by_session.fork_reason, by_session.session_id, by_session.spliced) == ("history_edited", "s1", False)


def test_tools_changed(fmt):
    lookup = MemoryLookup()
    _first_turn(fmt, lookup, tools=[TOOL])
    p = plan(_req([USER, ANSWER, Message("user", "?")], tools=[]), lookup, fmt)
    assert (p.spliced, p.fork_reason, p.parent_turn_id) == (False, "tools_changed", "t0")


def test_template_kwargs_changed(fmt):
    lookup = MemoryLookup()
    _first_turn(fmt, lookup, kwargs={"enable_thinking": True})
    p = plan(_req([USER, ANSWER, Message("user", "?")], kwargs={"enable_thinking": False}), lookup, fmt)
    assert (p.spliced, p.fork_reason, p.parent_turn_id) == (False, "template_kwargs_changed", "t0")


def test_thinking_stripped():
    """With ``tool_cycle`` retention the template drops earlier reasoning once a new user query
    arrives, so the recorded ids (which keep it) cannot be spliced: the turn forks."""
    fmt = ChatFormat(load_tokenizer(str(qwen3_tokenizer_dir())), "qwen3", thinking_retention="tool_cycle")
    lookup = MemoryLookup()
    req0 = _req([USER])
    p0 = plan(req0, lookup, fmt)
    answer = Message("assistant", "3.", reasoning="add them")
    out = fmt.tokenizer.encode("<think>\nadd them\n</think>\n\n3.<|im_end|>", add_special_tokens=False)
    lookup.record(req0, p0, "t0", answer, out)
    p = plan(_req([USER, answer, Message("user", "And 2+2?")]), lookup, fmt)
    assert not p.spliced and p.fork_reason == "thinking_stripped" and p.parent_turn_id == "t0"


@pytest.mark.parametrize("n", [2, 8])
def test_identical_histories_claim_distinct_parents(fmt, n):
    """N header-less sessions whose first answers coincide: each continuation takes a parent
    nobody continues yet, so every second turn lands in a different session."""
    lookup = MemoryLookup()
    firsts = [_first_turn(fmt, lookup, turn_id=f"t{k}")[0].session_id for k in range(n)]
    assert len(set(firsts)) == n
    follow = [USER, ANSWER, Message("user", "Are you sure?")]
    chosen = []
    for k in range(n):
        req = _req(follow)
        p = plan(req, lookup, fmt)
        assert p.spliced and p.ambiguous == (n > 1)
        lookup.claims.add(p.parent_turn_id)  # in flight until committed
        chosen.append(p.session_id)
    assert sorted(chosen) == sorted(firsts)


def test_all_continued_matches_branch_the_most_recent(fmt):
    """A rollback: every matching turn already has a continuation, so the request branches."""
    lookup = MemoryLookup()
    _first_turn(fmt, lookup, turn_id="a")
    _first_turn(fmt, lookup, turn_id="b")
    follow = [USER, ANSWER, Message("user", "Are you sure?")]
    for _ in range(2):
        req = _req(follow)
        p = plan(req, lookup, fmt)
        lookup.record(req, p, f"c-{p.parent_turn_id}", Message("assistant", "Yes."), [1, 2])
    again = plan(_req(follow), lookup, fmt)
    assert again.spliced and again.parent_turn_id == "b" and again.ambiguous


def test_a_splice_id_in_the_history_names_its_turn(fmt):
    """Identical histories, but the replayed items carry the id of one turn: that one is chosen,
    even though it is not the most recent and a free turn exists."""
    lookup = MemoryLookup()
    _first_turn(fmt, lookup, turn_id="a")
    _first_turn(fmt, lookup, turn_id="b")
    p = plan(_req([USER, ANSWER, Message("user", "?")], hint="a"), lookup, fmt)
    assert p.spliced and p.parent_turn_id == "a" and not p.ambiguous


def _pre_v6_fingerprints(hashed, req, answer, session_id) -> list[bytes]:
    """The rows a store before schema 6 held for a turn: one per key (exact, same tools, history
    only), unscoped and scoped, with no variant."""
    keys = fingerprint_keys(hashed.copy().extend([answer]), req)
    return [*(digest(k) for k in keys), *(digest(k, session_id) for k in keys)]


def test_one_fingerprint_row_per_scope(fmt):
    lookup = MemoryLookup()
    p, _ = _first_turn(fmt, lookup, tools=[TOOL], kwargs={"enable_thinking": False})
    rows = answer_fingerprints(p.history_hash.copy(), _req([USER], tools=[TOOL], kwargs={"enable_thinking": False}), ANSWER, p.session_id)
    assert len(rows) == 2 and rows[0][1] == rows[1][1] and len(rows[0][1]) == 16 and rows[0][0] != rows[1][0]


@pytest.mark.parametrize(
    "tools, kwargs, expect",
    [([TOOL], None, (True, None)), ([TOOL], {"enable_thinking": False}, (False, "template_kwargs_changed")),
     ([], None, (False, "tools_changed"))],
)  # fmt: skip
def test_a_turn_stored_before_schema_6_matches_as_it_did(fmt, tools, kwargs, expect):
    """Its rows have no variant: the exact and same-tools rows stored with it classify it."""
    lookup = MemoryLookup()
    req0 = _req([USER], tools=[TOOL])
    p0 = plan(req0, lookup, fmt)
    out = fmt.tokenizer.encode("The answer is 3.<|im_end|>", add_special_tokens=False)
    for fp in _pre_v6_fingerprints(p0.history_hash.copy().extend(req0.messages[p0.hashed :]), req0, ANSWER, p0.session_id):
        lookup.fps.setdefault(fp, []).append(Cand("t0", p0.session_id))
    lookup.ids["t0"], lookup.sessions["t0"] = (p0.prompt_ids, out), p0.session_id
    p = plan(_req([USER, ANSWER, Message("user", "?")], tools=tools, kwargs=kwargs), lookup, fmt)
    assert (p.spliced, p.fork_reason) == expect and p.parent_turn_id == "t0"


def test_exact_matches_win_over_more_recent_partial_ones(fmt):
    """Two recorded turns end the same history: the one asked with the request's tools is
    spliced onto, though another, asked with other tools, is more recent."""
    lookup = MemoryLookup()
    _first_turn(fmt, lookup, tools=[TOOL], turn_id="with")
    _first_turn(fmt, lookup, tools=[], turn_id="without")
    p = plan(_req([USER, ANSWER, Message("user", "?")], tools=[TOOL]), lookup, fmt)
    assert p.spliced and p.parent_turn_id == "with" and not p.ambiguous


def test_a_turn_recorded_under_the_earlier_history_hash_is_still_continued(fmt):
    """Releases before SHA-256 stored BLAKE2b-128 history fingerprints: a header-less session
    recorded then is still found (and spliced) after the upgrade, and its next answer is stored
    under the current hash."""
    from tokenization.conversation import HistoryHash

    lookup = MemoryLookup()
    req0 = _req([USER])
    p0 = plan(req0, lookup, fmt)
    out = fmt.tokenizer.encode("The answer is 3.<|im_end|>", add_special_tokens=False)
    old = HistoryHash(legacy=True).extend(req0.messages)  # what the earlier release stored
    for fp in _pre_v6_fingerprints(old, req0, ANSWER, p0.session_id):
        lookup.fps.setdefault(fp, []).append(Cand("t0", p0.session_id))
    lookup.ids["t0"], lookup.sessions["t0"] = (p0.prompt_ids, out), p0.session_id
    assert not any(fp in lookup.fps for fp in _pre_v6_fingerprints(HistoryHash().extend(req0.messages), req0, ANSWER, p0.session_id))
    req1 = _req([USER, ANSWER, Message("user", "Sure?")])
    p1 = plan(req1, lookup, fmt)
    assert p1.spliced and p1.fork_reason is None and p1.parent_turn_id == "t0" and p1.session_id == p0.session_id
    lookup.record(req1, p1, "t1", Message("assistant", "Yes."), out)
    p2 = plan(_req([USER, ANSWER, Message("user", "Sure?"), Message("assistant", "Yes."), Message("user", "Thanks")]), lookup, fmt)
    assert p2.spliced and p2.parent_turn_id == "t1"


def test_an_inline_plan_defers_full_renders_unknown_histories_and_long_new_messages(fmt, monkeypatch):
    """``inline_chars`` (the event loop's try): a splice with short new messages is planned; a
    first turn, a history no recorded turn matches (before its second, legacy pass over the
    history) and long new messages raise ``PlanOffLoop``, and plan as before without it."""
    import proxy.session.planner as planner

    legacy = []

    class Spy(planner.HistoryHash):
        def __init__(self, *a, **kw):
            legacy.append(kw.get("legacy", False))
            super().__init__(*a, **kw)

    monkeypatch.setattr(planner, "HistoryHash", Spy)
    lookup = MemoryLookup()
    with pytest.raises(PlanOffLoop):
        plan(_req([USER]), lookup, fmt, inline_chars=1000)
    _first_turn(fmt, lookup)
    assert plan(_req([USER, ANSWER, Message("user", "Sure?")]), lookup, fmt, inline_chars=1000).spliced
    long_new = _req([USER, ANSWER, Message("user", "x " * 600)])
    with pytest.raises(PlanOffLoop):
        plan(long_new, lookup, fmt, inline_chars=1000)
    assert plan(long_new, lookup, fmt).spliced
    unknown = [USER, Message("assistant", "Something else."), Message("user", "?")]
    legacy.clear()
    with pytest.raises(PlanOffLoop):
        plan(_req(unknown), lookup, fmt, inline_chars=1000)
    assert True not in legacy
    p = plan(_req(unknown), lookup, fmt)
    assert (p.spliced, p.fork_reason) == (False, "unknown_parent") and True in legacy
