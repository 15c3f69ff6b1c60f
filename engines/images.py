"""How a prompt's images travel to an engine (docs/engines.md, "Images").

Splice keeps every prompt *expanded*: one ``<|image_pad|>`` per vision token. Both released
engines expand placeholders themselves and break on ids that are already expanded (SGLang
0.5.23 counts every pad as an image: a 400 or a crash; vLLM 0.32 replaces the first pad of a
run per image and silently leaves the rest as text), so each span goes out **collapsed to
one pad** next to the image bytes as a ``data:`` URL, in prompt order. The engine expands it
again with its own image processor; the reply's prompt length (and vLLM's placeholder
ranges) must then match Splice's expanded prompt, else the two processors disagree.

Positions in replies (input logprobs, ``logprob_start_len``) are in expanded coordinates on
both engines, so nothing is mapped back.
"""

from __future__ import annotations

import base64
from collections import OrderedDict
from typing import Sequence

from engines.types import EngineImage, SamplingParams

# Added to a banned id's logit. Both engines take a float bias per id; vLLM clamps biases to
# [-100, 100] (``SamplingParams.from_optional``), so -100 is the strongest value both honour:
# exp(-100) ~ 4e-44 is zero in every float the sampler uses.
BAN_LOGIT_BIAS = -100.0

# Built data URLs by (hash, mime), bounded by their total size: a session re-sends every
# history image on every call, and screenshots are large.
_URL_CACHE_BYTES = 64 << 20
_url_cache: "OrderedDict[tuple[str, str], str]" = OrderedDict()
_url_cache_size = 0


def data_url(image: EngineImage) -> str:
    """``data:<mime>;base64,<bytes>`` for ``image``, encoded once per content hash while it
    stays in a 64 MiB cache."""
    global _url_cache_size
    key = (image.hash, image.mime)
    url = _url_cache.get(key)
    if url is not None:
        _url_cache.move_to_end(key)
        return url
    url = f"data:{image.mime};base64,{base64.b64encode(image.data).decode('ascii')}"
    if len(url) <= _URL_CACHE_BYTES:
        _url_cache[key] = url
        _url_cache_size += len(url)
        while _url_cache_size > _URL_CACHE_BYTES:
            _, old = _url_cache.popitem(last=False)
            _url_cache_size -= len(old)
    return url


def ban_bias(banned: Sequence[int]) -> dict[str, float]:
    """``{"<id>": -100.0}`` per banned id (JSON object keys are strings; both engines parse
    them back to ints and check them against the vocabulary)."""
    return {str(int(t)): BAN_LOGIT_BIAS for t in sorted(set(int(t) for t in banned))}


def stop_and_ban(params: SamplingParams) -> dict:
    """The optional sampling fields SGLang and vLLM name alike, present only when set: stop
    strings, stop ids and the ban (a text-only request without stops is unchanged)."""
    out: dict = {}
    if params.stop:
        out["stop"] = list(params.stop)
    if params.stop_token_ids:
        out["stop_token_ids"] = [int(t) for t in params.stop_token_ids]
    if params.banned_token_ids:
        # SGLang SamplingParams.logit_bias: Dict[str, float] (sglang/srt/sampling/sampling_params.py);
        # vLLM SamplingParams.logit_bias; both check the keys against the vocabulary and add the
        # bias to the logits before sampling.
        out["logit_bias"] = ban_bias(params.banned_token_ids)
    return out


def check_spans(input_ids: Sequence[int], images: Sequence[EngineImage]) -> None:
    """Raise ``ValueError`` unless every image is a run of one repeated id inside
    ``input_ids``, in prompt order, without overlaps."""
    end = 0
    for k, img in enumerate(images):
        if img.length < 1 or img.offset < end or img.offset + img.length > len(input_ids):
            raise ValueError(
                f"image {k} span [{img.offset}, {img.offset + img.length}) is out of order or outside "
                f"the {len(input_ids)}-token prompt"
            )
        pad = input_ids[img.offset]
        run = input_ids[img.offset : img.offset + img.length]
        if any(t != pad for t in run):
            raise ValueError(f"image {k} span at {img.offset} is not a run of one placeholder id")
        end = img.offset + img.length


def collapse(input_ids: Sequence[int], images: Sequence[EngineImage]) -> list[int]:
    """``input_ids`` with each image's run of pads replaced by its first pad."""
    out: list[int] = []
    pos = 0
    for img in images:
        out.extend(input_ids[pos : img.offset + 1])
        pos = img.offset + img.length
    out.extend(input_ids[pos:])
    return out


def in_image(pos: int, images: Sequence[EngineImage]) -> bool:
    """Whether expanded position ``pos`` is an image pad (images are few: a linear scan)."""
    return any(img.offset <= pos < img.offset + img.length for img in images)
