"""Images: stored once per content hash, referenced by the turns whose prompts hold them.

An image's bytes are written once, however many turns and sessions show it (agents re-send
every history screenshot on every call); a turn records only where each image of its prompt
sits (``ImageRef``: hash, offset of its first placeholder token, placeholder count, grid). The
table of bytes is apart from the token rows, so reading a turn's tokens never pages in pixels.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import orjson

from .db import Database
from .lru import LRU, memory_of


@dataclass(frozen=True)
class ImageRef:
    """Where one image sits in a token sequence: ``length`` placeholder tokens from ``offset``."""

    hash: str
    offset: int
    length: int
    grid_thw: tuple[int, int, int]

    def to_dict(self) -> dict:
        return {"hash": self.hash, "offset": self.offset, "length": self.length, "grid_thw": list(self.grid_thw)}

    def shifted(self, by: int) -> "ImageRef":
        return ImageRef(self.hash, self.offset + by, self.length, self.grid_thw)


@dataclass(frozen=True)
class StoredImage:
    """An image as stored: the bytes the client sent (their own encoding) and what was derived."""

    hash: str
    mime: str
    width: int
    height: int
    grid_thw: tuple[int, int, int]
    data: bytes


def pack_refs(refs: Sequence[ImageRef]) -> bytes:
    return orjson.dumps([[r.hash, r.offset, r.length, *r.grid_thw] for r in refs])


def unpack_refs(blob: bytes | None) -> tuple[ImageRef, ...]:
    if not blob:
        return ()
    return tuple(ImageRef(h, int(o), int(n), (int(t), int(gh), int(gw))) for h, o, n, t, gh, gw in orjson.loads(blob))


def write_images(c, images: Iterable[StoredImage], now: float) -> int:
    """Insert images not stored yet (one row per hash); returns how many were new."""
    new = 0
    for im in images:
        cur = c.execute(
            "INSERT OR IGNORE INTO images (hash, mime, width, height, grid_t, grid_h, grid_w, nbytes, data, created_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (im.hash, im.mime, im.width, im.height, *im.grid_thw, len(im.data), im.data, now),
        )
        new += cur.rowcount
    return new


class ImageTable:
    """Reads of stored images, with a bounded cache of recently sent ones (the engine gets every
    image of a prompt on every call, so a session's screenshots are read over and over)."""

    def __init__(self, db: Database, clock=time.time, cache_bytes: int = 256 << 20):
        self.db = db
        self.clock = clock
        self._cache = LRU(cache_bytes, weigh=lambda im: memory_of(im.data))
        self._known = LRU(1 << 16, sized=False)  # hashes known to be stored

    def remember(self, images: Iterable[StoredImage]) -> None:
        """Note images just committed (after COMMIT), so later turns neither re-insert nor re-read them."""
        for im in images:
            self._known.put(im.hash, True)
            self._cache.put(im.hash, im)

    def is_known(self, h: str) -> bool:
        return self._known.get(h) is not None

    def get(self, h: str) -> StoredImage | None:
        hit = self._cache.get(h)
        if hit is not None:
            return hit
        with self.db.read() as c:
            row = c.execute(
                "SELECT mime, width, height, grid_t, grid_h, grid_w, data FROM images WHERE hash = ?", (h,)
            ).fetchone()
        if row is None:
            return None
        im = StoredImage(h, row[0], int(row[1]), int(row[2]), (int(row[3]), int(row[4]), int(row[5])), bytes(row[6]))
        self._cache.put(h, im)
        self._known.put(h, True)
        return im

    def refs_of(self, turn_id: str) -> tuple[ImageRef, ...]:
        """The images of a turn's prompt, in prompt order (empty for a text-only turn)."""
        with self.db.read() as c:
            row = c.execute(
                "SELECT ti.refs FROM turn_images ti JOIN turns t ON t.seq = ti.turn_seq WHERE t.turn_id = ?", (turn_id,)
            ).fetchone()
        return unpack_refs(row[0]) if row else ()

    def stats(self) -> dict:
        with self.db.read() as c:
            n, nbytes = c.execute("SELECT COUNT(*), COALESCE(SUM(nbytes), 0) FROM images").fetchone()
            refs = c.execute("SELECT COUNT(*) FROM turn_images").fetchone()[0]
        return {"images": int(n), "image_bytes": int(nbytes), "turns_with_images": int(refs)}
