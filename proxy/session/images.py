"""The images of a turn's prompt: where each sits, what each engine call must send, what to store.

A full render places every image of the request in order; a spliced prompt keeps its parent's
images where they were (the parent's ids are kept verbatim) and adds the new messages' images
at their place in the bridge's ids. Nothing here re-decodes an image: the request's images
arrive decoded once (``tokenization.vision``), history images come from the store by hash.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engines.types import EngineImage
from tokenization import Message
from tokenization.conversation import message_images
from tokenization.vision import ImageInfo, image_spans

from ..store import ImageRef, StoredImage


def place(ids: Sequence[int], messages: Sequence[Message], spec, *, base: int = 0) -> tuple[ImageRef, ...]:
    """ImageRefs for the images of ``messages``, found in order in ``ids`` (offsets plus ``base``);
    ``ImageError`` when the runs and the images do not match one for one."""
    infos = message_images(list(messages))
    spans = image_spans(list(ids), infos, spec, base)
    return tuple(ImageRef(s.hash, s.offset, s.length, tuple(i.grid_thw)) for s, i in zip(spans, infos))


def request_images(messages: Sequence[Message]) -> dict[str, ImageInfo]:
    """The request's decoded images by hash (agents re-send the history's images every call).
    Images of a stored Responses conversation carry no bytes: those come from the store."""
    return {info.hash: info for info in message_images(list(messages)) if info.data}


def as_stored(info: ImageInfo) -> StoredImage:
    return StoredImage(info.hash, info.mime, info.width, info.height, tuple(info.grid_thw), info.data)


def engine_images(
    refs: Sequence[ImageRef], have: dict[str, ImageInfo], load: Callable[[str], StoredImage | None]
) -> list[EngineImage]:
    """What an engine call must send for ``refs``: bytes from the request when it has them, else
    from the store. A missing image is a clear error (the turn cannot be generated faithfully)."""
    out = []
    for r in refs:
        info = have.get(r.hash)
        if info is not None:
            data, mime = info.data, info.mime
        else:
            im = load(r.hash)
            if im is None:
                raise LookupError(f"image {r.hash} of this session's prompt is not stored")
            data, mime = im.data, im.mime
        out.append(EngineImage(r.hash, data, mime, r.offset, r.length, r.grid_thw))
    return out
