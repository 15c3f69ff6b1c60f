"""Which part of an episode a recorded call is: its role (docs/samples.md, "Episode roles").

One session is one *episode*: one task an agent harness works on, rewarded once. Harnesses send
more than the agent's own conversation inside it, and each call is recorded with a role:

- ``main``: the agent's conversation (what the reward is about);
- ``subagent``: a conversation the harness runs inside the episode (Claude Code's Task tool):
  a fresh conversation (no assistant message yet) that offers tools, under a system prompt other
  than the episode's main one;
- ``compacted``: the conversation restarted from a summary after the harness compacted its
  history (Codex's summary prefix, Claude Code's "This session is being continued ...", or a
  Responses ``compaction`` item Splice issued);
- ``auxiliary``: a harness side call (title, topic, summary for the UI, quota probes): a
  structured-output request without tools; or, once the episode's main conversation offered
  tools, a call offering none; or a fresh call without tools under another system prompt, or
  asking another model name, than the main conversation's.

The summarisation call of a compaction is a turn of the conversation it summarises (its role is
that conversation's), whatever it does to the tool list. A turn that continues a recorded turn
(spliced or forked from it) and is not auxiliary by the rules above takes its parent's role. A
harness can say what a call is with ``X-Splice-Role``; that wins.

Pure functions over the request and a few facts about the episode (``EpisodeFacts``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

from tokenization import Message

Role = Literal["main", "auxiliary", "subagent", "compacted"]
ROLES: tuple[str, ...] = ("main", "auxiliary", "subagent", "compacted")

# What a compaction's summarisation request ends with, and what the restarted history holds.
# Codex: codex-rs/core/templates/compact/prompt.md and summary_prefix.md; Claude Code: its
# compaction prompt and its continuation message.
SUMMARY_REQUEST_MARKERS = (
    "You are performing a CONTEXT CHECKPOINT COMPACTION",
    "Your task is to create a detailed summary of the conversation so far",
)
RESTART_MARKERS = (
    "Another language model started to solve this problem and produced a summary",
    "This session is being continued from a previous conversation",
)
# Structured-output requests, as the dialects record them (TurnRequest.controls_not_enforced).
STRUCTURED_CONTROLS = ("text.format", "response_format", "output_config.format")


@dataclass(frozen=True)
class EpisodeFacts:
    """What a new call of the episode is compared with: its main conversation's first call."""

    system: str  # fingerprint of its system / developer text
    tools: int  # how many tools it offered
    model: str  # the model name it asked for


def system_fingerprint(messages: list[Message]) -> str:
    """A short hash of the leading system / developer messages' text."""
    h = hashlib.blake2b(digest_size=8)
    for m in messages:
        if m.role not in ("system", "developer"):
            break
        h.update(m.content.encode())
        h.update(b"\x1e")
    return h.hexdigest()


def facts_of(messages: list[Message], tools: list, model: str) -> EpisodeFacts:
    return EpisodeFacts(system_fingerprint(messages), len(tools), model or "")


def _user_texts(messages: list[Message]):
    return (m.content for m in messages if m.role == "user" and m.content)


MARKER_WINDOW = 65536  # characters at each end of a message where a compaction prompt is looked for


def _ends(text: str) -> tuple[str, ...]:
    """The text, or its first and last ``MARKER_WINDOW`` characters when longer: a compaction
    prompt is a few KB the agent sends as its own message (Codex, Claude Code), while the last
    user message of a long session may be a 400 KB document that stays in every turn's history."""
    if len(text) <= 2 * MARKER_WINDOW:
        return (text,)
    return text[:MARKER_WINDOW], text[-MARKER_WINDOW:]


def compaction_kind(messages: list[Message], last_asst: int | None = None) -> Literal["summary", "restart"] | None:
    """``summary``: the request asks for a compaction summary of the history before it (a user
    message after its last assistant message is the compaction prompt); ``restart``: a history
    restarted from a summary (no assistant message, a user message starting with a summary
    prefix). ``last_asst``: the index of the last assistant message (-1: none), when known."""
    if last_asst is None:
        last_asst = next((i for i in range(len(messages) - 1, -1, -1) if messages[i].role == "assistant"), -1)
    if last_asst < 0:
        return "restart" if any(t.lstrip().startswith(RESTART_MARKERS) for t in _user_texts(messages)) else None
    # The prompt is not answered yet, so it comes after the last assistant message: a tool loop
    # under a long first user message scans nothing.
    prompt = next((m for m in reversed(messages[last_asst + 1 :]) if m.role == "user"), None)
    if prompt is not None and any(k in text for text in _ends(prompt.content) for k in SUMMARY_REQUEST_MARKERS):
        return "summary"
    return None


def classify(
    messages: list[Message],
    tools: list,
    model: str,
    *,
    declared: str | None,
    structured: bool,
    compaction: str | None,
    parent_role: str | None,
    main: EpisodeFacts | None,
) -> tuple[str, str]:
    """``(role, why)`` for one call; see the module doc for the rules, in order."""
    if declared:
        return declared, "declared"
    if compaction == "summary":
        return parent_role or "main", "compaction_summary"
    if compaction == "restart":
        return "compacted", "compaction_restart"
    fresh = not any(m.role == "assistant" for m in messages)
    if structured and not tools:
        return "auxiliary", "structured_output"
    if main is not None:
        if main.tools and not tools:
            return "auxiliary", "no_tools"
        if fresh and not tools and system_fingerprint(messages) != main.system:
            return "auxiliary", "other_system"
        if not tools and model and main.model and model != main.model:
            return "auxiliary", "other_model"
    if parent_role is not None:
        return parent_role, "parent"
    if fresh and main is not None and main.tools and tools and system_fingerprint(messages) != main.system:
        return "subagent", "fresh_with_other_system"
    return "main", "default"
