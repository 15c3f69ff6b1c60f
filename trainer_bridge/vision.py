"""Image inputs of a Qwen2.5-VL-architecture policy: settings, span checks, pixels, M-RoPE positions.

A sample of a vision session carries ``images: [{"hash", "offset", "length", "grid_thw"}]``:
``offset`` is the index of the image's first ``<|image_pad|>`` in the sample's token sequence,
``length`` the number of pads (``grid_t * grid_h * grid_w / merge_size**2``), ``grid_thw`` the
grid the proxy's image processor produced. The model needs, per micro-batch, the processed
``pixel_values`` of every image in token order and their ``image_grid_thw``; it places image
features on the pad tokens in order, so a span whose length disagrees with the pixels the
trainer computes would silently shift every later image (the placeholder-drift bug). Hence:

* the image processor is built from the model folder's ``preprocessor_config.json``
  (``Qwen2VLImageProcessorPil``, NumPy, no torchvision) and every image's grid is recomputed and
  compared with the recorded one (:class:`ImageInputError` on any difference);
* pixels are computed once per image hash and kept in a bounded cache (:class:`PixelCache`);
* position ids are the model's own ``get_rope_index`` (3 x L M-RoPE) per sample, concatenated
  for packed rows (:func:`packed_rope_positions`), positions restarting at every sample.

The vision control tokens (vision start/end/pad, image pad, video pad) are banned at sampling;
:attr:`VisionSettings.banned_ids` is the list the trainer's log-softmax leaves out too.
"""

from __future__ import annotations

import io
import json
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

VISION_MODEL_TYPES = ("qwen2_5_vl",)
VISION_CONTROL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
_PROCESSOR_TYPE_KEYS = ("image_processor_type", "processor_class", "auto_map")


class ImageInputError(ValueError):
    """A sample's image references disagree with its tokens or with the trainer's image processor."""


@dataclass(frozen=True)
class ImageRef:
    """One image of a sample: its content hash and its ``<|image_pad|>`` span in token coordinates."""

    hash: str
    offset: int
    length: int
    grid_thw: tuple[int, int, int]


@dataclass(frozen=True)
class VisionSettings:
    """What the trainer needs to know about a vision model folder (read once at start)."""

    processor_kwargs: dict[str, Any] = field(hash=False)
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int
    image_token_id: int
    video_token_id: int
    vision_start_id: int
    vision_end_id: int
    banned_ids: tuple[int, ...]
    in_channels: int = 3

    @classmethod
    def from_model_dir(cls, path: str | Path) -> "VisionSettings | None":
        """Settings of a Qwen2.5-VL folder; None for a text-only model."""
        path = Path(path)
        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, ValueError):
            return None
        if config.get("model_type") not in VISION_MODEL_TYPES:
            return None
        pre = path / "preprocessor_config.json"
        if not pre.is_file():
            raise ImageInputError(f"{path} is a {config['model_type']} model without preprocessor_config.json: "
                                  "the trainer cannot process its images the way the proxy did")
        kwargs = {k: v for k, v in json.loads(pre.read_text()).items() if k not in _PROCESSOR_TYPE_KEYS}
        size = kwargs.get("size") or {}
        min_pixels = int(kwargs.get("min_pixels") or size.get("shortest_edge") or 56 * 56)
        max_pixels = int(kwargs.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280)
        vision = config.get("vision_config") or {}
        ids = {
            "image_token_id": int(config.get("image_token_id", 151655)),
            "video_token_id": int(config.get("video_token_id", 151656)),
            "vision_start_id": int(config.get("vision_start_token_id", 151652)),
            "vision_end_id": int(config.get("vision_end_token_id", 151653)),
        }
        return cls(
            processor_kwargs=kwargs,
            patch_size=int(kwargs.get("patch_size", vision.get("patch_size", 14))),
            merge_size=int(kwargs.get("merge_size", vision.get("spatial_merge_size", 2))),
            temporal_patch_size=int(kwargs.get("temporal_patch_size", vision.get("temporal_patch_size", 2))),
            min_pixels=min_pixels,
            max_pixels=max_pixels,
            banned_ids=tuple(sorted(set(ids.values()) | set(_control_ids_in_vocab(path)))),
            in_channels=int(vision.get("in_channels", vision.get("in_chans", 3))),
            **ids,
        )

    def n_tokens(self, grid_thw: Sequence[int]) -> int:
        """Placeholder tokens of an image with this grid."""
        return math.prod(int(g) for g in grid_thw) // self.merge_size**2

    def grid_for_size(self, width: int, height: int) -> tuple[int, int, int]:
        """The grid the image processor gives a ``width x height`` image (its own ``smart_resize``)."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        h, w = smart_resize(height, width, factor=self.patch_size * self.merge_size,
                            min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        return (1, h // self.patch_size, w // self.patch_size)

    def processor(self) -> Any:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        return Qwen2VLImageProcessorPil(**self.processor_kwargs)

    def describe(self) -> str:
        return (f"patch {self.patch_size}, merge {self.merge_size}, min_pixels {self.min_pixels}, "
                f"max_pixels {self.max_pixels}")


def _control_ids_in_vocab(path: Path) -> list[int]:
    """Ids of the vision control tokens the tokenizer defines (``tokenizer.json`` added tokens)."""
    try:
        added = json.loads((path / "tokenizer.json").read_text()).get("added_tokens") or []
    except (OSError, ValueError):
        return []
    return [int(t["id"]) for t in added if t.get("content") in VISION_CONTROL_TOKENS]


def image_refs(sample: dict[str, Any]) -> list[ImageRef]:
    """The sample's image references, in token order (none for a text-only sample)."""
    refs = []
    for item in sample.get("images") or []:
        try:
            grid = tuple(int(g) for g in item["grid_thw"])
            ref = ImageRef(str(item["hash"]), int(item["offset"]), int(item["length"]), grid)  # type: ignore[arg-type]
        except (KeyError, TypeError, ValueError) as e:
            raise ImageInputError(f"sample {sample.get('sample_id')!r}: malformed image reference {item!r} ({e})") from e
        if len(grid) != 3:
            raise ImageInputError(f"sample {sample.get('sample_id')!r}: image {ref.hash} has grid_thw {list(grid)}, not 3 numbers")
        refs.append(ref)
    return sorted(refs, key=lambda r: r.offset)


def check_spans(sample: dict[str, Any], settings: VisionSettings) -> list[ImageRef]:
    """Each span covers exactly its ``<|image_pad|>`` tokens and has the grid's token count.

    Raises :class:`ImageInputError` naming the sample and image otherwise.
    """
    refs = image_refs(sample)
    ids = np.asarray(sample["input_ids"])
    sid = sample.get("sample_id")
    end = 0
    for ref in refs:
        expected = settings.n_tokens(ref.grid_thw)
        if ref.length != expected:
            raise ImageInputError(
                f"sample {sid!r}: image {ref.hash} spans {ref.length} tokens but its grid {list(ref.grid_thw)} "
                f"gives {expected} (grid product / merge_size**2 with merge_size {settings.merge_size})")
        if ref.offset < end or ref.offset < 0 or ref.offset + ref.length > len(ids):
            raise ImageInputError(f"sample {sid!r}: image {ref.hash} span [{ref.offset}, {ref.offset + ref.length}) "
                                  f"overlaps another image or leaves the {len(ids)}-token sequence")
        if (ids[ref.offset : ref.offset + ref.length] != settings.image_token_id).any():
            raise ImageInputError(f"sample {sid!r}: image {ref.hash} span [{ref.offset}, {ref.offset + ref.length}) "
                                  f"holds tokens other than <|image_pad|> ({settings.image_token_id})")
        end = ref.offset + ref.length
    return refs


def untrainable_reason(sample: dict[str, Any], settings: VisionSettings | None) -> str | None:
    """``banned_token`` when a loss token is a vision control id, or placeholder tokens lie outside
    the recorded image spans (a sampled pad kept as context); None otherwise."""
    if settings is None:
        return None
    ids, mask = np.asarray(sample["input_ids"]), np.asarray(sample["loss_mask"]).astype(bool)
    if np.isin(ids[mask], settings.banned_ids).any():
        return "banned_token"
    n_pads = int(np.isin(ids, (settings.image_token_id, settings.video_token_id)).sum())
    if n_pads != sum(r.length for r in image_refs(sample)):
        return "banned_token"
    return None


def check_grid(ref: ImageRef, grid: Sequence[int], settings: VisionSettings, sample_id: Any = None) -> None:
    """The trainer's image processor must give the grid the proxy recorded."""
    if tuple(int(g) for g in grid) != ref.grid_thw:
        raise ImageInputError(
            f"sample {sample_id!r}: image {ref.hash} was recorded with grid_thw {list(ref.grid_thw)} "
            f"({ref.length} tokens) but the trainer's image processor ({settings.describe()}, from the model "
            f"folder's preprocessor_config.json) gives {[int(g) for g in grid]}: the proxy and the trainer "
            "process images differently (check min_pixels / max_pixels on both sides)")


def decode_image(data: bytes) -> Any:
    """The stored image bytes (png/jpeg/webp/gif) as an RGB PIL image."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        return img.convert("RGB")


@dataclass
class ProcessedImage:
    pixel_values: torch.Tensor  # [grid_t * grid_h * grid_w, channels * temporal_patch * patch**2], float32
    grid_thw: tuple[int, int, int]

    @property
    def nbytes(self) -> int:
        return self.pixel_values.numel() * self.pixel_values.element_size()


class PixelCache:
    """Processed pixels per image hash: each image runs through the processor once.

    Bounded by ``max_bytes`` of pixel tensors (least recently used dropped first): a screenshot
    shared by the samples of a group or by consecutive steps is processed once.
    """

    def __init__(self, settings: VisionSettings, max_bytes: int = 2 << 30):
        self.settings = settings
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, ProcessedImage] = OrderedDict()
        self._bytes = 0
        self._processor = None
        self.n_processed = 0

    def get(self, ref: ImageRef, data: Callable[[], bytes] | bytes, sample_id: Any = None) -> ProcessedImage:
        item = self._items.get(ref.hash)
        if item is None:
            if self._processor is None:
                self._processor = self.settings.processor()
            raw = data() if callable(data) else data
            out = self._processor(images=[decode_image(raw)], return_tensors="pt")
            grid = tuple(int(g) for g in out["image_grid_thw"][0])
            item = ProcessedImage(out["pixel_values"].to(torch.float32), grid)  # type: ignore[arg-type]
            self.n_processed += 1
            self._items[ref.hash] = item
            self._bytes += item.nbytes
            while self._bytes > self.max_bytes and len(self._items) > 1:
                _, old = self._items.popitem(last=False)
                self._bytes -= old.nbytes
        else:
            self._items.move_to_end(ref.hash)
        check_grid(ref, item.grid_thw, self.settings, sample_id)
        return item


IMAGE_DATA_KEY = "image_data"  # on a sample handed to the learner: {hash: stored image bytes}


def batch_pixels(samples: Iterable[dict[str, Any]], cache: PixelCache) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(pixel_values, image_grid_thw)`` of the images of ``samples`` in token order, or ``(None, None)``.

    ``samples`` in the order their tokens are laid out in the micro-batch; each carries its image
    bytes under :data:`IMAGE_DATA_KEY` (attached on rank 0 by ``image_fetch.ImageSource``).
    """
    pixels, grids = [], []
    for sample in samples:
        refs = image_refs(sample)
        data = sample.get(IMAGE_DATA_KEY) or {}
        for ref in refs:
            if ref.hash not in data:
                raise ImageInputError(f"sample {sample.get('sample_id')!r}: no bytes for image {ref.hash} "
                                      "(fetch them with image_fetch.ImageSource.attach before the step)")
            item = cache.get(ref, data[ref.hash], sample.get("sample_id"))
            pixels.append(item.pixel_values)
            grids.append(item.grid_thw)
    if not pixels:
        return None, None
    return torch.cat(pixels), torch.tensor(grids, dtype=torch.long)


def dummy_pixels(settings: VisionSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest image input (one merged token): run through the vision tower, times 0, when a
    micro-batch has no image, so every rank runs the same FSDP collectives in every forward."""
    m = settings.merge_size
    dim = settings.in_channels * settings.temporal_patch_size * settings.patch_size**2
    return torch.zeros(m * m, dim), torch.tensor([[1, m, m]], dtype=torch.long)


def packed_rope_positions(
    get_rope_index: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    image_token_id: int,
) -> torch.Tensor:
    """``[4, rows, T]`` position ids: row 0 the text positions (restarting at 0 per sample, which is
    how transformers finds the packed samples and keeps attention inside each), rows 1-3 the
    model's own M-RoPE index (``get_rope_index``) computed for each sample alone and concatenated.

    Images are consumed from ``image_grid_thw`` in token order (row-major over the micro-batch).
    A sample without images gets ``arange`` on all three axes, which is what ``get_rope_index``
    gives text.
    """
    ids_cpu = input_ids.detach().cpu()
    pos_cpu = position_ids.detach().cpu()
    rope = torch.zeros((3, *ids_cpu.shape), dtype=torch.long)
    grids = image_grid_thw.detach().cpu() if image_grid_thw is not None else torch.zeros((0, 3), dtype=torch.long)
    used = 0
    for r in range(ids_cpu.shape[0]):
        starts = (pos_cpu[r] == 0).nonzero().flatten().tolist() + [ids_cpu.shape[1]]
        if starts[0] != 0:
            starts.insert(0, 0)
        for a, b in zip(starts[:-1], starts[1:]):
            ids = ids_cpu[r, a:b]
            is_image = ids == image_token_id
            n_images = int((is_image[1:] & ~is_image[:-1]).sum()) + int(bool(is_image[:1].any())) if len(ids) else 0
            if n_images == 0:
                rope[:, r, a:b] = torch.arange(b - a)
                continue
            seg_grids = grids[used : used + n_images]
            if len(seg_grids) != n_images:
                raise ImageInputError(f"{n_images} image spans in a packed sample but only {len(grids) - used} grids left")
            used += n_images
            pos, _ = get_rope_index(ids[None], is_image.to(torch.int)[None], image_grid_thw=seg_grids)
            rope[:, r, a:b] = pos[:, 0]
    if used != len(grids):
        raise ImageInputError(f"{len(grids)} images for {used} image spans in the micro-batch")
    text = pos_cpu.unsqueeze(0)
    return torch.cat([text, rope]).to(input_ids.device)
