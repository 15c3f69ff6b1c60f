"""Where a request's conversation items sit in its bytes, so that the next request of the same
conversation is parsed from what it adds.

An agent resends its whole history every turn, written out the same way each time (compact
JSON: httpx, ``JSON.stringify``, serde). The items a request shares with the conversation's
last request are then the same bytes at the same offsets. Given where the last request's items
end (a ``Layout``), one ``memcmp`` finds how many of them the new request repeats; the bytes
before them are the same too, so the parser would be inside the same array at the same item.
Those items are cut out of the bytes and the rest (the new items and the fields around them)
is parsed; the kept objects take their place. Parsing, comparing and freeing the history then
cost what the new items cost, not what the conversation does.

A layout is only ever built from a request that was parsed in full: each item's compact JSON
(``orjson.dumps``) must be the bytes at its offset, and the body with those items cut out must
parse to the body without them (which proves the array is the top-level field, not a nested
one that looks alike). A client whose bytes differ (pretty-printed, escaped differently) gets
no layout and is parsed in full, as before.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any, Sequence

import orjson

MIN_BYTES = 16 << 10  # bodies shorter than this are parsed whole: the cut costs more than it saves
WINDOW = 64  # bytes after the array's "[" that tell conversations apart before any parsing


@dataclass(frozen=True)
class Layout:
    """A request's bytes and where its first ``len(ends)`` items of the ``field`` array end:
    ``body[start]`` is the array's ``[``, ``body[ends[i]]`` the ``,`` or ``]`` after item ``i``."""

    body: bytes
    start: int
    ends: tuple[int, ...]


def field_start(raw: bytes, field: str) -> int:
    """The offset of the ``[`` after the first compact ``"field":`` (-1: none). Not proof that it
    is the top-level field: only a ``Layout`` built by ``layout_of`` is."""
    at = raw.find(b'"%s":[' % field.encode())
    return at + len(field) + 3 if at >= 0 else -1


def shared_items(raw: bytes, layout: Layout) -> int:
    """How many of ``layout``'s items ``raw`` repeats, with every byte before them."""
    ends, old = layout.ends, memoryview(layout.body)
    lo, hi = 0, len(ends)  # raw repeats items [0, lo); not all of [0, hi]
    if hi and raw.startswith(old[: ends[hi - 1] + 1]):
        return hi
    if hi > 1 and raw.startswith(old[: ends[hi - 2] + 1]):  # a marker moved off the last item
        return hi - 1
    hi -= 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if raw.startswith(old[: ends[mid - 1] + 1]):
            lo = mid
        else:
            hi = mid - 1
    return lo


@functools.lru_cache(maxsize=None)  # one per dialect's field
def _field_again(field: str) -> re.Pattern[bytes]:
    return re.compile(rb'"%s"\s*:\s*\[' % re.escape(field.encode()))


def parse_after(raw: bytes, layout: Layout, k: int, field: str) -> dict[str, Any] | None:
    """``raw`` parsed with its first ``k`` items (``shared_items``) cut out, or None when the
    result would not be the body without them: a trailing comma, a second ``field``, a parse
    error (the full parse reports it)."""
    cut = layout.ends[k - 1]
    after = cut + 1 if raw[cut] == 44 else cut  # after a "," or from the "]"
    if _field_again(field).search(raw, after):
        return None  # the field again (the last one wins) or an item's own: parse in full
    view = memoryview(raw)
    try:
        body = orjson.loads(b"".join((view[: layout.start + 1], view[after:])))
    except orjson.JSONDecodeError:
        return None
    items = body.get(field) if type(body) is dict else None
    if type(items) is not list or (after > cut and not items):
        return None
    return body


def extend_ends(raw: bytes, start: int, ends: Sequence[int], items: Sequence[Any]) -> tuple[int, ...]:
    """``ends`` extended over ``items[len(ends):]`` while each item's compact JSON is the bytes at
    its offset and a ``,`` or ``]`` follows."""
    out = list(ends)
    at = (out[-1] if out else start) + 1
    for item in items[len(out) :]:
        text = orjson.dumps(item)
        end = at + len(text)
        if not raw.startswith(text, at) or end >= len(raw) or raw[end] not in b",]":
            break
        out.append(end)
        at = end + 1
    return tuple(out)


def layout_of(raw: bytes, body: dict[str, Any], field: str, start: int, items: Sequence[Any]) -> Layout | None:
    """A verified layout for ``raw`` (parsed in full into ``body``) over ``items``, a prefix of
    ``body[field]``: None unless cutting those items out parses to ``body`` without them."""
    if start < 0:
        return None
    ends = extend_ends(raw, start, (), items)
    if not ends:
        return None
    layout = Layout(raw, start, ends)
    cut = parse_after(raw, layout, len(ends), field)
    if cut is None or cut != {**body, field: body[field][len(ends) :]}:
        return None
    return layout
