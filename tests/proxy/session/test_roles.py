"""The role rules (proxy.session.roles), ``keep`` over tool-definition edits and the summary's
sampled ids carried into a restarted prompt: the pure planner on the real Qwen3 chat format."""

from __future__ import annotations

import pytest

from proxy.session.planner import carry_summary, plan
from proxy.session.roles import EpisodeFacts, classify, compaction_kind, system_fingerprint
from proxy.session.turn import TurnRequest
from tests.proxy.session.test_planner import MemoryLookup
from tokenization import ChatFormat, Message, Tool, ToolCall, load_tokenizer, qwen3_tokenizer_dir

SYS, SUB = Message("system", "You are the agent."), Message("system", "You are a sub-agent.")
BASH = Tool("Bash", "Run a command.", {"type": "object", "properties": {"command": {"type": "string"}}})


@pytest.fixture(scope="module")
def fmt():
    return ChatFormat(load_tokenizer(str(qwen3_tokenizer_dir())), "qwen3")


def _classify(messages, tools=(BASH,), model="m", main=None, **kw):
    args = {"declared": None, "structured": False, "compaction": compaction_kind(messages), "parent_role": None} | kw
    return classify(messages, list(tools), model, main=main, **args)


def test_role_rules():
    main = EpisodeFacts(system_fingerprint([SYS]), 1, "big")
    u = Message("user", "go")
    a = Message("assistant", "ok")
    # before anything: a structured-output call without tools is a side call; the rest is main
    assert _classify([SYS, u], tools=(), structured=True) == ("auxiliary", "structured_output")
    assert _classify([SYS, u]) == ("main", "default")
    # once the main conversation offered tools: a call offering none is a side call
    assert _classify([SYS, u, a, u], tools=(), main=main, parent_role="main") == ("auxiliary", "no_tools")
    # a fresh conversation with tools under another system prompt is a sub-agent
    assert _classify([SUB, u], main=main) == ("subagent", "fresh_with_other_system")
    # a continuation takes its parent's role; a restart of the main conversation stays main
    assert _classify([SUB, u, a, u], main=main, parent_role="subagent") == ("subagent", "parent")
    assert _classify([SYS, u], main=main) == ("main", "default")
    # another model name, no tools, when the episode offered none either
    assert _classify([SYS, u], tools=(), model="small", main=EpisodeFacts(main.system, 0, "big")) == ("auxiliary", "other_model")
    # compaction: the summary call is its conversation's; the restart is compacted
    ask = Message("user", "You are performing a CONTEXT CHECKPOINT COMPACTION. Summarise.")
    assert _classify([SYS, u, a, ask], tools=(), main=main, parent_role="main") == ("main", "compaction_summary")
    restart = Message("user", "This session is being continued from a previous conversation that ran out of context. ...")
    assert _classify([SYS, restart], main=main) == ("compacted", "compaction_restart")
    # the harness's word wins
    assert _classify([SYS, u], tools=(), structured=True, declared="main") == ("main", "declared")


def test_keep_covers_tool_definition_edits(fmt):
    lookup = MemoryLookup()
    first = [SYS, Message("user", "list")]
    req = TurnRequest(api="chat", messages=first, tools=[BASH], turn_id="t0", session_id="s", history_edits_policy="keep")
    p0 = plan(req, lookup, fmt)
    out = fmt.tokenizer.encode('<tool_call>\n{"name": "Bash", "arguments": {"command": "ls"}}\n</tool_call><|im_end|>', add_special_tokens=False)
    answer = Message("assistant", "", tool_calls=(ToolCall("c1", "Bash", '{"command": "ls"}'),))
    lookup.record(req, p0, "t0", answer, out)
    later = first + [answer, Message("tool", "a.txt", tool_call_id="c1")]
    edited = Tool("Bash", "Run a command. Footer: model X.", BASH.parameters)
    added = Tool("Read", "Read a file.", {"type": "object", "properties": {"path": {"type": "string"}}})
    for tools in ([edited], [BASH, added], []):  # description edited, a tool added, all removed
        p = plan(TurnRequest(api="chat", messages=later, tools=tools, turn_id="t1", session_id="s", history_edits_policy="keep"), lookup, fmt)
        assert p.spliced and p.history_edits == ("tools",) and p.prompt_ids[: len(p0.prompt_ids) + len(out)].tolist() == p0.prompt_ids.tolist() + out
    sys2 = [Message("system", "You are the agent, v2.")] + later[1:]
    p = plan(TurnRequest(api="chat", messages=sys2, tools=[edited], turn_id="t2", session_id="s", history_edits_policy="keep"), lookup, fmt)
    assert p.spliced and p.history_edits == ("system_text", "tools")
    p = plan(TurnRequest(api="chat", messages=later, tools=[edited], turn_id="t3", session_id="s", history_edits_policy="fork"), lookup, fmt)
    assert not p.spliced and p.fork_reason == "tools_changed"


def test_summary_ids_are_carried_even_where_the_text_merges_with_its_neighbours(fmt):
    tok = fmt.tokenizer
    summary = "Goal: count the files. Done: 2 files found. Next: nothing."
    sampled = tok.encode(summary, add_special_tokens=False)
    out = sampled + [fmt.stop_token_ids[0]]
    summary_prompt = fmt.render([SYS, Message("user", "summarise")], [])
    restarted = fmt.render([SYS, Message("user", f"Summary of earlier work:\n{summary}\nContinue.")], [BASH])
    new, carried = carry_summary(fmt, restarted, summary_prompt, out)
    assert carried
    assert tok.decode(new) == tok.decode(restarted)  # the same text ...
    assert any(new[i : i + len(sampled)] == sampled for i in range(len(new)))  # ... holding the sampled ids
    # a summary the restarted history does not hold verbatim is left as rendered
    assert carry_summary(fmt, fmt.render([SYS, Message("user", "Summary: something else")], []), summary_prompt, out) == (
        fmt.render([SYS, Message("user", "Summary: something else")], []), False)


def test_a_compaction_prompt_is_found_at_either_end_of_a_long_message():
    """Markers are looked for in the first and last 64K characters of a long message: where an
    agent's compaction prompt sits, without scanning a 400 KB document on every turn."""
    from proxy.session.roles import MARKER_WINDOW, SUMMARY_REQUEST_MARKERS

    marker = SUMMARY_REQUEST_MARKERS[1]
    doc = "word " * (MARKER_WINDOW // 2)  # 2.5 windows of text
    for content, kind in ((marker + "\n" + doc, "summary"), (doc + "\n" + marker, "summary"), (marker + " short", "summary"),
                          (doc[: len(doc) // 2] + marker + doc[len(doc) // 2 :], None), (doc, None)):  # fmt: skip
        history = [Message("user", "fix it"), Message("assistant", "done"), Message("user", content)]
        assert compaction_kind(history) == kind, (len(content), kind)


def test_only_a_user_message_after_the_last_answer_asks_for_a_summary():
    """A compaction prompt is the newest user message, not yet answered. A tool loop whose first
    user message happens to quote the prompt is no compaction (and its long first message is not
    scanned on every turn)."""
    from proxy.session.roles import SUMMARY_REQUEST_MARKERS

    quoted = Message("user", "Review this text: " + SUMMARY_REQUEST_MARKERS[0])
    call = Message("assistant", "", tool_calls=(ToolCall(id="c1", name="bash", arguments="{}"),))
    loop = [quoted, call, Message("tool", "ok", tool_call_id="c1")]
    assert compaction_kind(loop) is None
    assert compaction_kind([*loop, Message("assistant", "done"), Message("user", SUMMARY_REQUEST_MARKERS[0])]) == "summary"
    assert compaction_kind([quoted]) is None  # nothing answered yet: nothing to summarise
