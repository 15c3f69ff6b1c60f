"""``header_map`` answers every lookup the turn path makes as starlette's ``Headers.get`` does
(first value of a repeated header, latin-1 text, absent names None)."""

from __future__ import annotations

from types import SimpleNamespace

from starlette.datastructures import Headers

from proxy.api.context import CLIENT_SESSION_HEADERS, header_map

RAW = [
    (b"host", b"127.0.0.1:8000"),
    (b"x-session-id", b"first"),
    (b"content-type", b"application/json"),
    (b"x-session-id", b"second"),
    (b"x-group-id", "gr\u00fcppe".encode("latin-1")),
    (b"session-id", b""),
    (b"x-splice-role", b" Judge "),
]
NAMES = ["x-session-id", "x-group-id", "x-group-size", "x-splice-role", "x-splice-history-edits", "host", *CLIENT_SESSION_HEADERS]


def test_every_lookup_equals_starlettes():
    mine, theirs = header_map(SimpleNamespace(scope={"headers": RAW})), Headers(raw=RAW)
    for name in NAMES:
        assert mine.get(name) == theirs.get(name), name
    assert mine["x-session-id"] == "first" and mine["x-group-id"] == "gr\u00fcppe"
