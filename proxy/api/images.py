"""Image parts of the three dialects -> decoded ``ImageInfo``s, with the limits and the cache.

* Chat ``{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}``,
  Responses ``{"type": "input_image", "image_url": "data:..."}``, Anthropic
  ``{"type": "image", "source": {"type": "base64", "media_type": ..., "data": ...}}``.
* A remote ``http(s)`` URL (Anthropic ``{"type": "url"}``) is refused unless
  ``allow_image_urls``; then it is fetched (``max_image_bytes``, ``image_fetch_timeout_s``)
  before the request is converted, from public addresses only (``image_fetch``), and only a
  URL whose bytes decoded as an image is remembered.
* Cost: a request's images together may have at most ``max_request_image_pixels`` pixels (checked
  from each image's header before its pixels are decoded), and at most ``image_decode_concurrency``
  decodes run at once in the whole proxy (each holds its image's pixels several times over). ``file_id`` references are always refused (Splice keeps no
  files).
* ``ImageInput`` lives on the app (``app.state.images``): the model's ``VisionSpec`` (None for
  a text-only model: image parts are a 400), the limits and one ``ImageCache``, so an image an
  agent resends every turn is decoded once. ``ImageRequest`` is one request's view: it counts
  images against ``max_images_per_request`` and turns every ``ImageError`` into a 400 naming
  the part.
* ``ImageInput.prepare(body)`` (async, in the route) decodes a request's images in a worker
  thread and fetches allowed URLs; the dialect conversion then only looks them up. Without it
  (unit use, ``count_tokens``) the conversion decodes inline.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from tokenization.vision import ImageCache, ImageError, ImageInfo, ImageLimits, VisionSpec, check_limits

from ..errors import APIError, bad_request
from .image_fetch import FETCH_FAILED, Network, fetch_bytes, guarded_client, parse_nets
from .image_fetch import log as fetch_log

URL_CACHE_ENTRIES = 64
URL_CACHE_BYTES = 64 * 1024 * 1024

IMAGE_PART_TYPES = frozenset({"image_url", "input_image", "image", "computer_screenshot"})
_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(?:;[^;,]*)*),", re.DOTALL)


@dataclass(frozen=True)
class ImageSource:
    """Where an image part's bytes are: inline base64 text, or a remote URL."""

    b64: str | None = None
    url: str | None = None


def source_of(part: dict[str, Any], where: str) -> ImageSource:
    """The source an image part names, in any of the three dialects' shapes; 400 otherwise."""
    typ = part.get("type")
    if typ == "image":  # Anthropic
        src = part.get("source")
        if not isinstance(src, dict):
            raise bad_request(f"{where} (image) needs a 'source' object", code="invalid_image", param=f"{where}.source")
        kind = src.get("type")
        if kind == "base64":
            data = src.get("data")
            if not isinstance(data, str):
                raise bad_request(f"{where}.source needs base64 'data'", code="invalid_image", param=f"{where}.source.data")
            return ImageSource(b64=data)
        if kind == "url":
            return _url_source(src.get("url"), f"{where}.source.url")
        if kind == "file":
            raise _no_files(f"{where}.source")
        raise bad_request(f"{where}.source.type must be 'base64' or 'url', got {kind!r}", code="invalid_image", param=f"{where}.source.type")
    if typ == "image_url":  # Chat
        iu = part.get("image_url")
        url = iu.get("url") if isinstance(iu, dict) else iu
        return _url_source(url, f"{where}.image_url")
    if typ in ("input_image", "computer_screenshot"):  # Responses
        if part.get("image_url") is not None:
            return _url_source(part.get("image_url"), f"{where}.image_url")
        if part.get("file_id") is not None:
            raise _no_files(f"{where}.file_id")
        raise bad_request(f"{where} (input_image) needs an 'image_url'", code="invalid_image", param=f"{where}.image_url")
    raise bad_request(f"{where} is not an image part", code="invalid_image", param=where)


def _no_files(where: str) -> APIError:
    return bad_request(
        f"{where}: Splice keeps no uploaded files; send the image inline as a base64 data URL", code="invalid_image", param=where
    )


def _url_source(url: Any, where: str) -> ImageSource:
    if not isinstance(url, str) or not url:
        raise bad_request(f"{where} must be a URL string (a data URL or http(s))", code="invalid_image", param=where)
    if url.startswith("data:"):
        m = _DATA_URL.match(url[:256])
        if m is None or "base64" not in m.group("params").split(";"):
            raise bad_request(f"{where}: a data URL must be 'data:<mime>;base64,<data>'", code="invalid_image", param=where)
        mime = m.group("mime") or ""
        if mime and not mime.startswith("image/"):
            raise bad_request(f"{where}: data URL media type {mime!r} is not an image", code="invalid_image", param=where)
        return ImageSource(b64=url[m.end() :])
    if url.startswith(("http://", "https://")):
        return ImageSource(url=url)
    raise bad_request(f"{where}: unsupported image URL scheme (use a base64 data URL)", code="invalid_image", param=where)


def b64_bytes(text: str, limits: ImageLimits) -> bytes:
    """Base64 text -> bytes; ``ImageError`` when it is not base64 or decodes above the limit."""
    if len(text) * 3 // 4 > limits.max_bytes + 3:  # checked before decoding anything
        raise ImageError(f"image is about {len(text) * 3 // 4} bytes, above the limit of {limits.max_bytes} bytes", "image_too_large")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        pass
    try:  # base64 wrapped over lines, as some encoders write it
        return base64.b64decode(re.sub(r"\s+", "", text), validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("image data is not valid base64") from None


def return_large_buffers() -> bool:
    """Make glibc hand every allocation of 1 MiB or more straight back to the OS when freed.

    A decoded image is ~13.4 bytes per pixel at its peak (a 7000 x 7000 PNG: 657 MB), in large
    blocks. With glibc's default (a threshold that rises after frees, and one heap per thread)
    decodes in different worker threads kept their blocks: 4 worst-case images one at a time
    peaked at 1.78 GB and held 170 MB after. With a fixed threshold each block is its own
    mapping, unmapped on free: the peak is ``image_decode_concurrency`` x 657 MB and nothing is
    held (``python -m proxy.bench.image_memory``). Vision models only; a no-op elsewhere."""
    try:
        import ctypes
        import ctypes.util

        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(-3, 1 << 20))  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc
        return False


def _code(exc: ImageError) -> str:
    return getattr(exc, "code", "invalid_image")


@dataclass
class ImageInput:
    """The proxy's image settings and decode cache (one per app)."""

    spec: VisionSpec | None
    limits: ImageLimits = field(default_factory=ImageLimits)
    max_images: int = 64
    allow_urls: bool = False
    fetch_timeout_s: float = 10.0
    cache: ImageCache = field(default_factory=ImageCache)
    max_request_pixels: int = 256_000_000
    allow_nets: tuple[Network, ...] = ()  # fetched from although not public (--image-url-allow-net)
    resolver: Any = None  # tests: async (host, port) -> addresses, instead of the system resolver
    _url_cache: OrderedDict = field(default_factory=OrderedDict)  # url -> ImageInfo (decoded fine)
    _url_lock: Any = field(default_factory=threading.Lock)

    @classmethod
    def from_settings(cls, settings, spec: VisionSpec | None) -> "ImageInput":
        if spec is not None:
            return_large_buffers()
        slots = threading.BoundedSemaphore(settings.image_decode_concurrency)
        return cls(
            spec=spec,
            limits=ImageLimits(max_bytes=settings.max_image_bytes, max_pixels=settings.max_image_pixels),
            max_images=settings.max_images_per_request,
            allow_urls=settings.allow_image_urls,
            fetch_timeout_s=settings.image_fetch_timeout_s,
            cache=ImageCache(max_entries=settings.image_cache_entries, max_bytes=settings.image_cache_bytes, decode_slots=slots),
            max_request_pixels=settings.max_request_image_pixels,
            allow_nets=parse_nets(settings.image_url_allow_net),
        )

    def request(self) -> "ImageRequest":
        """A fresh per-request view (nothing prepared: images decode as they are met)."""
        return ImageRequest(self)

    def decode_b64(self, text: str, limits: ImageLimits | None = None) -> ImageInfo:
        assert self.spec is not None
        limits = limits or self.limits
        return self.cache.decode_text(text, lambda t: b64_bytes(t, limits), self.spec, limits)

    def _budgeted(self, spent: int) -> ImageLimits:
        """The per-image limits with the pixel limit lowered to what the request has left."""
        left = max(0, self.max_request_pixels - spent)
        if left >= self.limits.max_pixels:
            return self.limits
        return ImageLimits(max_bytes=self.limits.max_bytes, max_pixels=left, max_aspect_ratio=self.limits.max_aspect_ratio)

    def _over_budget(self, exc: ImageError, limits: ImageLimits) -> ImageError:
        if limits is not self.limits and getattr(exc, "code", None) == "image_too_large" and "pixels" in str(exc):
            return ImageError(
                f"the request's images have more than {self.max_request_pixels:,} pixels together "
                "(max_request_image_pixels)", "image_too_large",
            )  # fmt: skip
        return exc

    async def prepare(self, body: Any) -> "ImageRequest":
        """A request's view with its images decoded off the event loop and its allowed URLs fetched.

        Only a vision model's requests are walked; errors are kept and raised, with the part's
        place, when the conversion meets the part."""
        req = ImageRequest(self)
        if self.spec is None:
            return req
        parts = list(_image_parts(body))
        if not parts:
            return req
        if len(parts) > self.max_images:
            raise bad_request(
                f"{len(parts)} images in one request, more than {self.max_images} (max_images_per_request)", code="too_many_images"
            )
        sources: list[tuple[dict, ImageSource | APIError]] = []
        for part in parts:
            try:
                sources.append((part, source_of(part, "image")))
            except APIError as exc:
                sources.append((part, exc))
        urls = [s.url for _, s in sources if isinstance(s, ImageSource) and s.url and self.allow_urls]
        fetched: dict[str, bytes | ImageError] = {}
        if urls:
            fetched = await self._fetch_all(urls)

        def decode_all() -> None:
            for part, src in sources:
                if not isinstance(src, ImageSource):
                    continue
                limits = self._budgeted(req.pixels)
                try:
                    if src.b64 is not None:
                        info = self.decode_b64(src.b64, limits)
                    elif src.url in fetched:
                        info = self._decode_fetched(src.url, fetched[src.url], limits)
                    else:
                        continue
                except ImageError as exc:
                    req.resolved[id(part)] = self._over_budget(exc, limits)
                    continue
                req.pixels += info.width * info.height
                req.resolved[id(part)] = info

        await asyncio.to_thread(decode_all)
        req.keep = parts  # the ids above stay valid while the parts live
        return req

    def _decode_fetched(self, url: str, got: "bytes | ImageInfo | None", limits: ImageLimits) -> ImageInfo:
        """A fetched URL's image; only one that decoded is remembered (by URL). Failures are all
        ``FETCH_FAILED`` (an agent learns nothing about what answered), except the request's
        own pixel budget."""
        if isinstance(got, ImageInfo):  # remembered
            check_limits(got, limits)
            return got
        if got is None:
            raise ImageError(FETCH_FAILED)
        try:
            info = self.cache.decode(got, self.spec, limits)
        except ImageError as exc:
            if limits is not self.limits and getattr(exc, "code", None) == "image_too_large":
                raise
            fetch_log.info("image URL %s: %s", url[:200], exc)
            raise ImageError(FETCH_FAILED) from None
        with self._url_lock:  # decodes run in worker threads
            self._url_cache[url] = info
            self._url_cache.move_to_end(url)
            while len(self._url_cache) > URL_CACHE_ENTRIES or sum(len(i.data) for i in self._url_cache.values()) > URL_CACHE_BYTES:
                self._url_cache.popitem(last=False)
        return info

    async def _fetch_all(self, urls: list[str]) -> dict[str, "bytes | ImageInfo | None"]:
        out: dict[str, bytes | ImageInfo | None] = {}
        todo = []
        for u in dict.fromkeys(urls):
            info = self._url_cache.get(u)
            if info is not None:
                self._url_cache.move_to_end(u)
                out[u] = info
            else:
                todo.append(u)
        if not todo:
            return out
        async with guarded_client(self.fetch_timeout_s, self.allow_nets, self.resolver) as client:
            results = await asyncio.gather(*(fetch_bytes(client, u, self.limits.max_bytes, self.fetch_timeout_s) for u in todo))
        out.update(zip(todo, results))
        return out


def _image_parts(obj: Any):
    """Every image part (any dialect's shape) in a request body, in document order."""
    if isinstance(obj, dict):
        typ = obj.get("type")
        if isinstance(typ, str) and typ in IMAGE_PART_TYPES and ("image_url" in obj or "source" in obj or "file_id" in obj):
            yield obj
            return
        for v in obj.values():
            if isinstance(v, (dict, list)):
                yield from _image_parts(v)
    elif isinstance(obj, list):
        for v in obj:
            if isinstance(v, (dict, list)):
                yield from _image_parts(v)


class ImageRequest:
    """One request's images: decoded (or prepared) parts, counted against the limit."""

    def __init__(self, images: ImageInput | None):
        self.images = images
        self.resolved: dict[int, ImageInfo | ImageError] = {}
        self.keep: list[Any] = []
        self.count = 0
        self.pixels = 0  # decoded pixels of this request's images, against max_request_pixels

    def image(self, part: dict[str, Any], where: str) -> ImageInfo:
        """The ``ImageInfo`` of an image part; a 400 naming ``where`` when it cannot be used."""
        inp = self.images
        if inp is None or inp.spec is None:
            raise bad_request(
                f"{where} has type '{part.get('type')}': this model takes text only (it has no image processor)",
                code="unsupported_content", param=where,
            )  # fmt: skip
        self.count += 1
        if self.count > inp.max_images:
            raise bad_request(
                f"{where}: more than {inp.max_images} images in one request (max_images_per_request)", code="too_many_images", param=where
            )
        got = self.resolved.get(id(part))
        if isinstance(got, ImageInfo):
            return got
        if isinstance(got, ImageError):
            raise bad_request(f"{where}: {got}", code=_code(got), param=where)
        src = source_of(part, where)
        if src.url is not None:
            if not inp.allow_urls:
                raise bad_request(
                    f"{where}: remote image URLs are not fetched unless the proxy runs with --allow-image-urls; "
                    "send the image inline as a base64 data URL",
                    code="image_url_not_allowed", param=where,
                )  # fmt: skip
            raise bad_request(f"{where}: the image URL was not fetched", code="invalid_image", param=where)
        limits = inp._budgeted(self.pixels)
        try:
            info = inp.decode_b64(src.b64 or "", limits)
        except ImageError as exc:
            exc = inp._over_budget(exc, limits)
            raise bad_request(f"{where}: {exc}", code=_code(exc), param=where) from None
        self.pixels += info.width * info.height
        return info
