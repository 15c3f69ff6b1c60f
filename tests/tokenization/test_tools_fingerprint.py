"""The tools' fingerprint is the BLAKE2b of their sorted JSON (``json.dumps(sort_keys=True)``),
whether it was computed or reused from an earlier turn with the same tools
(tokenization/conversation.py): values that compare equal but write differently (``1``, ``1.0``,
``True``) and NaN never share one, and an edit is always seen."""

from __future__ import annotations

import hashlib
import json

from tokenization.conversation import Tool, tools_fingerprint


def _reference(tools: list[Tool]) -> str:
    data = [[t.name, t.description, t.parameters] for t in tools]
    return hashlib.blake2b(json.dumps(data, sort_keys=True).encode(), digest_size=8).hexdigest()


def _tools(minimum, description: str = "Run a command.") -> list[Tool]:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": minimum}, "cmd": {"type": "string"}}}
    return [Tool("shell", description, schema), Tool("read", "Read a file.", {"type": "object", "properties": {}})]


def test_a_reused_fingerprint_is_the_one_a_fresh_hash_gives():
    seen = {}
    for _ in range(3):  # the same tools every turn, as agents send them: reused from the second on
        for description in ("Run a command.", "Run a command!"):
            for value in (1, 1.0, True, 2, float("nan"), None, "1"):  # NaN and None both write null
                tools = _tools(value, description)
                got = tools_fingerprint(tools)
                assert got == _reference(tools), (value, description)
                seen.setdefault(got, set()).add((repr(value), description))
    assert all(len(v) == 1 for v in seen.values())  # 1, 1.0 and True never share a fingerprint
    assert len(seen) == 14


def test_tools_changed_in_place_are_hashed_again():
    tools = _tools(1)
    before = tools_fingerprint(tools)
    tools[0].parameters["properties"]["cmd"]["description"] = "the command"
    assert tools_fingerprint(tools) == _reference(tools) != before
