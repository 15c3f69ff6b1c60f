"""Splice's conversation model: the one shape both OpenAI front ends convert into.

Frozen dataclasses so a recorded history can be compared and fingerprinted cheaply. The
conversion to the `renderers` package's message dicts lives here too, so no other module
needs to know that format.
"""

from __future__ import annotations

import json
import operator
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Literal, Sequence, Union

import orjson

from .vision import ImageInfo

Role = Literal["system", "developer", "user", "assistant", "tool"]


_LONG_DIGITS = re.compile(r"\d{19}")


@dataclass(frozen=True)
class ToolCall:
    """A function call the assistant made. ``arguments`` is the JSON text as sent on the wire."""

    id: str
    name: str
    arguments: str

    def arguments_value(self) -> Any:
        """Arguments as a JSON value (for comparisons that ignore spacing); the raw text if invalid."""
        if _LONG_DIGITS.search(self.arguments) is None:  # orjson reads integers past 64 bits as floats
            try:  # the same values as json's, several times faster (every call in every turn's history)
                return orjson.loads(self.arguments)
            except (ValueError, TypeError):  # NaN, Infinity: json reads them
                pass
        try:
            return json.loads(self.arguments)
        except (ValueError, TypeError):
            return self.arguments


# One piece of a message's content: text, or an image.
Part = Union[str, ImageInfo]


@dataclass(frozen=True)
class Message:
    """One message. ``parts``: the content as ordered text and image parts, set only when the
    message carries images (then ``content`` is its text parts joined by newlines, for
    display; the template renders ``parts``)."""

    role: Role
    content: str = ""
    reasoning: str | None = None  # assistant only
    tool_calls: tuple[ToolCall, ...] = ()  # assistant only
    tool_call_id: str | None = None  # tool only
    name: str | None = None  # tool only: the function name, when the client gives it
    parts: tuple[Part, ...] = ()

    @classmethod
    def from_parts(cls, role: Role, parts, **kw: Any) -> "Message":
        """A message from ordered parts: with ``parts`` kept only if one of them is an image
        (a text-only message stays the plain string it always was)."""
        parts = tuple(parts)
        text = "\n".join(p for p in parts if isinstance(p, str))
        if not any(isinstance(p, ImageInfo) for p in parts):
            return cls(role=role, content=text, **kw)
        return cls(role=role, content=text, parts=parts, **kw)

    @property
    def images(self) -> tuple[ImageInfo, ...]:
        return tuple(p for p in self.parts if isinstance(p, ImageInfo))

    @property
    def has_images(self) -> bool:
        return any(isinstance(p, ImageInfo) for p in self.parts)


def message_images(messages) -> list[ImageInfo]:
    """The images of ``messages`` in the order the chat template puts them in the prompt."""
    return [p for m in messages for p in m.parts if isinstance(p, ImageInfo)]


def has_images(messages) -> bool:
    return any(m.has_images for m in messages)


def template_content(msg: Message) -> Any:
    """The ``content`` a chat template sees: the string, or (with images) a list of
    ``{"type": "text", "text": ...}`` and ``{"type": "image"}`` parts in order."""
    if not msg.has_images:
        return msg.content
    return [{"type": "image"} if isinstance(p, ImageInfo) else {"type": "text", "text": p} for p in msg.parts]


@dataclass(frozen=True)
class Tool:
    """A function tool definition (OpenAI's flat shape).

    ``spec``: the function object as the client sent it (every field, in its order: ``strict``
    and whatever else a client adds; the name as the model is offered it), which is what the
    chat template renders, as inference servers' own chat endpoints do. None: built from
    ``name``, ``description`` and ``parameters``.
    """

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=dict, hash=False, compare=True)
    spec: dict[str, Any] | None = field(default=None, hash=False, compare=True)

    def template_spec(self) -> dict[str, Any]:
        """The function object the chat template sees."""
        if self.spec is not None:
            return self.spec
        return {"name": self.name, "description": self.description, "parameters": self.parameters}

    def extra_fields(self) -> dict[str, Any]:
        """Fields the client sent beyond name, description and parameters (``strict``, ...)."""
        if self.spec is None:
            return {}
        return {k: v for k, v in self.spec.items() if k not in ("name", "description", "parameters")}


def to_renderer_message(msg: Message, *, keep_developer: bool = False, images: bool = True) -> dict[str, Any]:
    """Convert to the message dict chat templates and the `renderers` package read.

    ``developer`` becomes ``system`` unless ``keep_developer`` (a template that knows the role).
    Tool-call arguments are passed as JSON values, as vLLM and SGLang pass them to templates
    (the raw text when it is not valid JSON). A message with images has list content
    (``template_content``); ``images=False`` gives its text only (for checks that read text).
    """
    role = "system" if msg.role == "developer" and not keep_developer else msg.role
    out: dict[str, Any] = {"role": role, "content": template_content(msg) if images else msg.content}
    if msg.role == "assistant":
        if msg.reasoning:
            out["reasoning_content"] = msg.reasoning
        if msg.tool_calls:
            out["tool_calls"] = [
                {
                    "type": "function",
                    "id": tc.id,
                    "function": {"name": tc.name, "arguments": tc.arguments_value()},
                }
                for tc in msg.tool_calls
            ]
    elif msg.role == "tool":
        if msg.tool_call_id:
            out["tool_call_id"] = msg.tool_call_id
        if msg.name:
            out["name"] = msg.name
    return out


def to_renderer_messages(messages: list[Message] | tuple[Message, ...], *, keep_developer: bool = False, images: bool = True) -> list[dict[str, Any]]:
    return [to_renderer_message(m, keep_developer=keep_developer, images=images) for m in messages]


def to_renderer_tools(tools: list[Tool] | tuple[Tool, ...] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    return [
        {"name": t.name, "description": t.description, "parameters": t.parameters or {"type": "object", "properties": {}}}
        for t in tools
    ]


def to_template_tools(tools: list[Tool] | tuple[Tool, ...] | None) -> list[dict[str, Any]] | None:
    """Tools in OpenAI's nested Chat Completions shape, field for field as the client sent them,
    as templates expect them: ``{"type": "function", "function": {"name", "description", ...}}``."""
    if not tools:
        return None
    return [{"type": "function", "function": t.template_spec()} for t in tools]


def _canonical_message(msg: Message, *, system_text: bool = True, arguments: bool = True) -> list[Any]:
    """What identifies a message for session matching.

    Tool-call arguments compare as JSON values (spacing and key order do not matter); ids and
    reasoning are left out (clients rename call ids and most Chat clients drop reasoning).
    ``developer`` and ``system`` are the same role to the template. ``system_text=False`` /
    ``arguments=False``: the edit-tolerant forms (``HistoryHash(edits=True)``) leave out the
    system / developer text, or the tool-call arguments (the names and count still count).
    """
    role = "system" if msg.role == "developer" else msg.role
    calls = [[tc.name, tc.arguments_value()] if arguments else [tc.name] for tc in msg.tool_calls]
    content: Any = msg.content.strip() if role == "assistant" else msg.content
    if msg.has_images:  # where each image sits and which pixels it holds
        content = [["image", p.hash] if isinstance(p, ImageInfo) else ["text", p] for p in msg.parts]
    if role == "system" and not system_text:
        content = ""
    return [role, content, calls]


# The edits a harness makes to a history it replays that ``--history-edits keep`` tolerates, as
# (name, what the canonical form leaves out); the first that matches names the edit.
EDIT_FORMS: tuple[tuple[tuple[str, ...], dict[str, bool]], ...] = (
    (("system_text",), {"system_text": False}),
    (("tool_arguments",), {"arguments": False}),
    (("system_text", "tool_arguments"), {"system_text": False, "arguments": False}),
)


def _dump(canon: list[Any]) -> bytes:
    try:
        return orjson.dumps(canon, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # e.g. integers wider than 64 bits in tool arguments
        return json.dumps(canon, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()


class HistoryHash:
    """An incremental hash of a message history: extend it, copy it, read its digest.

    The session layer hashes a request's history once, then continues the same hash with the
    new messages and the returned answer, instead of hashing the whole history twice.
    ``edits=True`` also keeps the edit-tolerant hashes (``EDIT_FORMS``), read with
    ``edit_hexdigests``.

    SHA-256 (its first 128 bits): a long session's history is hashed on every turn, and with
    the SHA extensions of today's server CPUs it runs about three times as fast as BLAKE2b
    (0.17 against 0.50 ms for 300 KB). ``legacy=True`` is the BLAKE2b-128 of earlier releases,
    which the session layer still looks up when nothing matched, so a session recorded before
    the change continues after it.
    """

    def __init__(self, _h=None, *, edits: bool = False, legacy: bool = False, _edit_hs=None):
        import hashlib

        new = (lambda: hashlib.blake2b(digest_size=16)) if legacy else hashlib.sha256
        self._h = _h or new()
        if _edit_hs is not None:
            self._edit_hs = _edit_hs
        elif edits:
            self._edit_hs = [new() for _ in EDIT_FORMS]
        else:
            self._edit_hs = None

    @property
    def edits(self) -> bool:
        return self._edit_hs is not None

    def extend(self, messages) -> "HistoryHash":
        for m in messages:
            self._h.update(_dump(_canonical_message(m)))
            self._h.update(b"\x1e")
            if self._edit_hs is not None:
                for h, (_, form) in zip(self._edit_hs, EDIT_FORMS):
                    h.update(_dump(_canonical_message(m, **form)))
                    h.update(b"\x1e")
        return self

    def copy(self) -> "HistoryHash":
        return HistoryHash(self._h.copy(), _edit_hs=None if self._edit_hs is None else [h.copy() for h in self._edit_hs])

    def hexdigest(self) -> str:
        return self._h.hexdigest()[:32]

    def edit_hexdigests(self) -> list[tuple[tuple[str, ...], str]]:
        """``(edits, digest)`` per edit-tolerant form; empty unless built with ``edits=True``."""
        if self._edit_hs is None:
            return []
        return [(names, h.hexdigest()[:32]) for h, (names, _) in zip(self._edit_hs, EDIT_FORMS)]


def fingerprint(messages: list[Message] | tuple[Message, ...]) -> str:
    """A stable hash of a message history, used to find the turn a request continues."""
    return HistoryHash().extend(messages).hexdigest()


def tools_fingerprint(tools: list[Tool] | tuple[Tool, ...] | None) -> str:
    """A stable hash of the tools offered, part of every history fingerprint of a turn.

    Agents send the same tools every turn (``json.dumps(sort_keys=True)`` writes 66 KB of them
    in about 0.3 ms here): the last fingerprints are kept per tool names with the tools' JSON as
    orjson writes it (about ten times faster), and reused only when that JSON and the values are
    equal (``1``, ``1.0`` and ``True`` write differently; a NaN never equals itself)."""
    import hashlib

    data = []
    for t in tools or []:
        row: list[Any] = [t.name, t.description, t.parameters]
        sent = list(t.template_spec().items())
        if sent != [("name", t.name), ("description", t.description), ("parameters", t.parameters)]:
            row.append(sent)  # only then: tools sent in the plain shape keep the fingerprint they had
        data.append(row)
    try:
        exact: bytes | None = orjson.dumps(data)
    except TypeError:  # integers wider than 64 bits, keys that are not strings
        exact = None
    key = tuple(row[0] for row in data)
    if exact is not None:
        with _TOOLS_LOCK:
            hit = _TOOLS_FP.get(key)
        if hit is not None and hit[0] == exact and hit[1] == data:
            return hit[2]
    fp = hashlib.blake2b(json.dumps(data, sort_keys=True).encode(), digest_size=8).hexdigest()
    if exact is not None:
        with _TOOLS_LOCK:
            _TOOLS_FP[key] = (bytes(memoryview(exact)), data, fp)  # orjson's own bytes keep spare room
            _TOOLS_FP.move_to_end(key)
            while len(_TOOLS_FP) > 64:
                _TOOLS_FP.popitem(last=False)
    return fp


_TOOLS_FP: OrderedDict[tuple, tuple[bytes, list, str]] = OrderedDict()  # tool names -> (JSON, values, fingerprint)
_TOOLS_LOCK = threading.Lock()


_CONTENT = operator.attrgetter("content")


class HistoryHashes:
    """Long histories hashed recently: a request that resends one of them with messages added
    hashes only the added ones.

    A long session sends its whole history every turn; hashing a 400 KB history costs about
    0.25 ms here, comparing it with the one kept from the turn before a memcmp per message. The
    kept messages must equal the request's first messages exactly (frozen dataclasses, every
    field), so a reuse is never a guess. Histories are kept per first two messages (where a
    session's system prompt and task sit) and the start of the third (where a group's sessions
    part), the newest only, up to ``max_chars`` of content in all; histories of fewer than
    ``min_messages`` messages and ``min_chars`` characters are hashed as they are. Many short
    messages cost as much to hash as one long one: a 200-message tool loop hashed every turn
    grew each turn's cost with the session. When the request's messages are the objects the
    last request's were (``proxy/api/history_memo.py``), the comparison is one identity check
    each. Thread-safe: planning may run in a worker thread."""

    def __init__(self, *, min_chars: int = 32_768, min_messages: int = 8, max_chars: int = 64 << 20):
        self.min_chars, self.min_messages, self.max_chars = min_chars, min_messages, max_chars
        self._kept: OrderedDict[tuple, tuple[tuple[Message, ...], HistoryHash, int]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()
        self.reused = 0  # hashes continued from a kept history (a count for tests and benches)

    def hash(self, messages: Sequence[Message], *, edits: bool = False) -> HistoryHash:
        """``HistoryHash(edits=edits).extend(messages)``, continued from a kept prefix when one matches."""
        msgs = tuple(messages)
        chars = sum(map(len, map(_CONTENT, msgs))) + 64 * len(msgs)  # a message's own objects count too
        if len(msgs) < 2 or (chars < self.min_chars and len(msgs) < self.min_messages):
            return HistoryHash(edits=edits).extend(msgs)
        key = (edits, *((m.role, len(m.content), m.content[:64], m.tool_calls[:1]) for m in msgs[:3]))
        with self._lock:
            kept = self._kept.get(key)
        h = None
        if kept is not None and len(kept[0]) <= len(msgs) and kept[0] == msgs[: len(kept[0])]:
            h = kept[1].copy().extend(msgs[len(kept[0]) :])
            self.reused += 1
        if h is None:
            h = HistoryHash(edits=edits).extend(msgs)
        with self._lock:
            old = self._kept.pop(key, None)
            if old is not None:
                self._chars -= old[2]
            self._kept[key] = (msgs, h.copy(), chars)
            self._chars += chars
            while self._chars > self.max_chars and self._kept:
                self._chars -= self._kept.popitem(last=False)[1][2]
        return h
