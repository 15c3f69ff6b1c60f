"""A JSON request body that may go out as several pieces, written with one ``writev``.

A long session's prompt is its ids as JSON text, kept from earlier turns (engines/ids_json.py).
Joining that text into one buffer, then copying it again into the body ``orjson`` writes, cost
two copies of ~600 KB per turn at 100k ids. ``JsonPieces`` is that text as it is kept; a body
holding one goes out as the list of its parts.
"""

from __future__ import annotations

from typing import Any, Sequence, Union

import orjson

_NUMPY = orjson.OPT_SERIALIZE_NUMPY

Content = Union[bytes, Sequence[bytes]]
"""A request body: one buffer, or pieces sent back to back (never empty pieces)."""


class JsonPieces(tuple):
    """Pieces of bytes whose concatenation is one JSON value (a body's top-level field)."""

    __slots__ = ()


def encode_body(body: Any) -> Content:
    """``body`` as JSON: bytes, or a list of pieces when a top-level field is ``JsonPieces``."""
    if not isinstance(body, dict) or not any(type(v) is JsonPieces for v in body.values()):
        return orjson.dumps(body, option=_NUMPY)
    rest = {k: v for k, v in body.items() if type(v) is not JsonPieces}
    out: list[bytes] = [b"{"]
    for key, value in body.items():
        if type(value) is JsonPieces:
            out.append(orjson.dumps(key) + b":")
            out.extend(value)
            out.append(b",")
    tail = orjson.dumps(rest, option=_NUMPY)
    if len(tail) > 2:  # "{...}": its fields after the pieces
        out.append(tail[1:])
    else:  # no other field: the last comma closes the object instead
        out[-1] = b"}"
    return out


def content_bytes(content: Content | None) -> bytes | None:
    """The body as one buffer (for paths that need it whole: httpx requests, tests)."""
    if content is None or isinstance(content, bytes):
        return content
    return b"".join(content)


def content_length(content: Content | None) -> int:
    if content is None:
        return 0
    if isinstance(content, bytes):
        return len(content)
    return sum(map(len, content))
