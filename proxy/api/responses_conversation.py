"""The stored form of a Responses conversation: a JSON list of messages (prefix-friendly), what
``previous_response_id`` expands to. Images are kept by reference (their bytes are stored once,
by hash, with the turn)."""

from __future__ import annotations

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


def messages_to_json(messages: list[Message]) -> bytes:
    """The stored form of a conversation: a JSON list of messages (prefix-friendly)."""
    return orjson.dumps([message_to_dict(m) for m in messages])


def messages_from_json(data: bytes | str) -> list[Message]:
    raw = orjson.loads(data)
    if isinstance(raw, dict):  # tolerate {"messages": [...]}
        raw = raw.get("messages", [])
    return [message_from_dict(d) for d in raw]

