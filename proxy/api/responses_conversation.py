"""The stored form of a Responses conversation: a JSON list of messages (prefix-friendly), what
``previous_response_id`` expands to. Images are kept by reference (their bytes are stored once,
by hash, with the turn)."""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from typing import Any

import orjson

from tokenization.conversation import Message, ToolCall
from tokenization.vision import ImageInfo


def message_to_dict(m: Message) -> dict[str, Any]:
    d: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.reasoning is not None:
        d["reasoning"] = m.reasoning
    if m.tool_calls:
        d["tool_calls"] = [{"id": tc.id, "name": tc.name, "arguments": tc.arguments} for tc in m.tool_calls]
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        d["name"] = m.name
    if m.has_images:  # images by reference: their bytes are stored once, by hash, with the turn
        d["parts"] = [
            {"text": p} if isinstance(p, str) else
            {"image": {"hash": p.hash, "mime": p.mime, "width": p.width, "height": p.height, "grid_thw": list(p.grid_thw), "n_tokens": p.n_tokens}}
            for p in m.parts
        ]  # fmt: skip
    return d


def _part_from_dict(p: dict[str, Any]) -> Any:
    if "image" not in p:
        return p.get("text", "")
    i = p["image"]
    # ``data`` is not kept with the conversation: the image store has it under ``hash``.
    return ImageInfo(hash=i["hash"], mime=i["mime"], width=i["width"], height=i["height"], grid_thw=tuple(i["grid_thw"]), n_tokens=i["n_tokens"], data=b"")


def message_from_dict(d: dict[str, Any]) -> Message:
    return Message(
        role=d["role"],
        content=d.get("content") or "",
        reasoning=d.get("reasoning"),
        tool_calls=tuple(ToolCall(tc["id"], tc["name"], tc["arguments"]) for tc in d.get("tool_calls") or ()),
        tool_call_id=d.get("tool_call_id"),
        name=d.get("name"),
        parts=tuple(_part_from_dict(p) for p in d.get("parts") or ()),
    )


class _ConversationJSON:
    """The stored JSON of recent conversations, kept by their first message object.

    A client that resends its whole input every turn sends its history again, and it converts
    to the same ``Message`` objects (``history_memo``): the next conversation is written as the
    bytes of the messages it shares with the kept one (compared in C, by identity first) plus
    its own, not as a dump of every message each turn. Bounded by the bytes kept, least
    recently used dropped first."""

    def __init__(self, max_bytes: int = 32 << 20):
        self.max_bytes = max_bytes
        self._kept: OrderedDict[int, tuple[list[Message], bytes, array]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def dumps(self, messages: list[Message]) -> bytes:
        if not messages:
            return b"[]"
        first = id(messages[0])
        with self._lock:
            hit = self._kept.get(first)
        j = 0
        if hit is not None and hit[0][0] is messages[0]:
            kept = hit[0]
            j = min(len(kept), len(messages))
            if messages[:j] != kept[:j]:  # equal messages write equal JSON
                j = next(i for i in range(j) if messages[i] != kept[i])
        head, ends = (hit[1][: hit[2][j - 1]], hit[2][:j]) if j else (b"[", array("q"))
        parts = [orjson.dumps(message_to_dict(m)) for m in messages[j:]]
        at = len(head) if j else 0  # where the bracket or comma before each new message sits
        for p in parts:
            at += 1 + len(p)
            ends.append(at)  # where the message's JSON ends
        out = (head + (b"," if j else b"") + b",".join(parts) if parts else head) + b"]"
        cost = len(out) + 8 * len(ends) + 8 * len(messages)
        with self._lock:
            old = self._kept.pop(first, None)
            if old is not None:
                self._bytes -= len(old[1]) + 16 * len(old[0])
            if cost <= self.max_bytes:
                self._kept[first] = (list(messages), out, ends)
                self._bytes += len(out) + 16 * len(messages)
            while self._bytes > self.max_bytes and self._kept:
                _, (m, b, _e) = self._kept.popitem(last=False)
                self._bytes -= len(b) + 16 * len(m)
        return out


_JSON = _ConversationJSON()


def messages_to_json(messages: list[Message]) -> bytes:
    """The stored form of a conversation: a JSON list of messages (prefix-friendly), the bytes
    ``orjson.dumps([message_to_dict(m) for m in messages])`` writes."""
    return _JSON.dumps(messages)


def messages_from_json(data: bytes | str) -> list[Message]:
    raw = orjson.loads(data)
    if isinstance(raw, dict):  # tolerate {"messages": [...]}
        raw = raw.get("messages", [])
    return [message_from_dict(d) for d in raw]

