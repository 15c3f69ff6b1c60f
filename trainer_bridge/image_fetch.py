"""Rank 0 fetches the images a batch's samples refer to, once per hash, and checks them.

Samples carry image references, not pixels (``vision.ImageRef``); the bytes live in the proxy's
store, one copy per content hash, served by ``GET /v1/images/{hash}`` with the admin token
(:meth:`~trainer_bridge.client.ProxyClient.image_bytes`, or any ``fetch(hash) -> bytes``).
Before the step is planned, rank 0:

1. checks every sample's spans against its tokens (``vision.check_spans``);
2. fetches each distinct image once (a bounded cache of recent bytes spares refetching the
   same screenshots in the next step), decodes it and recomputes its grid with the model's
   image-processor settings: a grid different from the recorded one is the placeholder-drift bug
   and stops training with :class:`~trainer_bridge.vision.ImageInputError` (on every rank);
3. attaches the bytes to the sample (``sample["image_data"] = {hash: bytes}``), so each rank is
   sent its share's images with its samples and never talks to the proxy.

The encoded bytes travel, not pixels: a 1280x720 PNG screenshot is a few hundred kB, its pixels
as float32 22.5 MB (docs/training.md, "Images").
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from .vision import IMAGE_DATA_KEY, ImageInputError, VisionSettings, check_grid, check_spans, decode_image


class ImageSource:
    """``fetch(hash) -> bytes`` plus the per-hash byte cache and the checks of :func:`attach`."""

    def __init__(self, settings: VisionSettings, fetch: Callable[[str], bytes], *, max_cache_bytes: int = 256 << 20):
        self.settings = settings
        self.fetch = fetch
        self.max_cache_bytes = max_cache_bytes
        self._bytes: OrderedDict[str, tuple[bytes, tuple[int, int, int]]] = OrderedDict()
        self._size = 0
        self.n_fetched = 0

    def _get(self, image_hash: str) -> tuple[bytes, tuple[int, int, int]]:
        """(bytes, grid by this trainer's processor settings), fetched and decoded once per hash."""
        hit = self._bytes.get(image_hash)
        if hit is not None:
            self._bytes.move_to_end(image_hash)
            return hit
        data = self.fetch(image_hash)
        self.n_fetched += 1
        try:
            image = decode_image(data)
        except Exception as e:  # PIL raises several types for undecodable data
            raise ImageInputError(f"image {image_hash}: the proxy's stored bytes do not decode ({e})") from e
        hit = (data, self.settings.grid_for_size(*image.size))
        self._bytes[image_hash] = hit
        self._size += len(data)
        while self._size > self.max_cache_bytes and len(self._bytes) > 1:
            _, (old, _) = self._bytes.popitem(last=False)
            self._size -= len(old)
        return hit

    def attach(self, samples: Sequence[dict[str, Any]]) -> int:
        """Check and attach the images of ``samples`` in place; returns how many images they hold."""
        n = 0
        for sample in samples:
            refs = check_spans(sample, self.settings)
            if not refs:
                continue
            data = {}
            for ref in refs:
                raw, grid = self._get(ref.hash)
                check_grid(ref, grid, self.settings, sample.get("sample_id"))
                data[ref.hash] = raw
            sample[IMAGE_DATA_KEY] = data
            n += len(refs)
        return n
