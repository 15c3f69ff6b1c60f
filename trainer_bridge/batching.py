"""Turn pulled samples into micro-batches under a token budget: packed (what the trainer uses) or padded.

**Packed** (:func:`pack_micro_batches`): several samples concatenated, ``T <= max_tokens``
tokens per micro-batch (a longer sample is its own micro-batch), in one ``[1, T]`` row or in
rows as wide as the longest sample (:func:`pack_rows`). ``position_ids`` restart at 0 at
each sample and ``attention_mask`` is None, which is transformers' packed-sequence path: sdpa and
eager build a block-diagonal causal mask from the position ids, flash-attention runs varlen, so
attention never crosses samples. ``seq_ids`` says which sample (0, 1, ...) each token belongs to.
One row has no padding at all; several rows only at row ends.

**Padded** (:func:`make_micro_batches`): each sample one right-padded row, padding with
``attention_mask`` 0 and ``loss_mask`` 0; the budget counts padded slots (rows x longest row).

Either way every per-token array of the pull API is laid out the same way, so index ``[b, i]``
of every tensor describes the same token (docs/design.md section 2).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

# Per-token arrays of a pulled sample, with their tensor dtype and padding value.
TOKEN_FIELDS: dict[str, tuple[torch.dtype, float]] = {
    "input_ids": (torch.long, 0),
    "loss_mask": (torch.float32, 0),
    "logprobs": (torch.float32, 0.0),
    "versions": (torch.long, -1),
    "proximal_logprobs_t": (torch.float32, 0.0),
    "proximal_versions": (torch.long, -1),
}


@dataclass
class MicroBatch:
    """Tensors ``[rows, T]`` in token coordinates.

    Padded: ``sample_indices[b]`` is row ``b``'s sample. Packed: ``attention_mask`` None, and
    ``seq_ids[r, i]`` indexes ``sample_indices`` for the token at ``[r, i]`` (-1 on padding).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    logprobs: torch.Tensor
    versions: torch.Tensor
    proximal_logprobs_t: torch.Tensor
    proximal_versions: torch.Tensor
    advantages: torch.Tensor
    sample_indices: list[int]
    proximal_logprobs: torch.Tensor | None = field(default=None)  # filled in by the trainer
    seq_ids: torch.Tensor | None = field(default=None)  # which sample each token is; -1 on padding
    pixel_values: torch.Tensor | None = field(default=None)  # a vision policy's images, in token order
    image_grid_thw: torch.Tensor | None = field(default=None)  # [images, 3]
    rope_position_ids: torch.Tensor | None = field(default=None)  # [4, rows, T]: text positions + M-RoPE

    def __post_init__(self) -> None:
        if self.seq_ids is None:  # padded rows: row b is sample b
            rows = torch.arange(self.input_ids.shape[0]).unsqueeze(1).expand_as(self.input_ids)
            valid = self.attention_mask.bool() if self.attention_mask is not None else torch.ones_like(rows, dtype=torch.bool)
            self.seq_ids = torch.where(valid, rows, torch.full_like(rows, -1))

    @property
    def n_tokens(self) -> int:
        """Token slots this micro-batch runs through the model (padding included)."""
        return self.input_ids.numel()

    @property
    def n_loss_tokens(self) -> int:
        return int(self.loss_mask.sum().item())

    def to(self, device: torch.device | str) -> "MicroBatch":
        moved = {
            k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()
        }
        return MicroBatch(**moved)


def validate_sample(sample: dict[str, Any]) -> int:
    """Return the sample's length ``L``; raise if any per-token array has another length."""
    length = len(sample["input_ids"])
    for key in TOKEN_FIELDS:
        if key not in sample:
            raise ValueError(f"sample {sample.get('sample_id')!r} has no {key!r}")
        if len(sample[key]) != length:
            raise ValueError(
                f"sample {sample.get('sample_id')!r}: {key!r} has {len(sample[key])} entries, input_ids has {length}"
            )
    return length


def plan_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Group sample indices so that ``rows * longest_row <= max_tokens`` (a longer sample rides alone)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for i in order:
        if groups:
            current = groups[-1]
            longest = lengths[current[0]]  # longest-first, so the first row is the longest
            if (len(current) + 1) * longest <= max_tokens:
                current.append(i)
                continue
        groups.append([i])
    return groups


def collate(
    samples: Sequence[dict[str, Any]], indices: Sequence[int], advantages: Sequence[float], pad_id: int = 0
) -> MicroBatch:
    """Right-pad the given samples into one :class:`MicroBatch`."""
    rows = [samples[i] for i in indices]
    lengths = [validate_sample(s) for s in rows]
    width = max(lengths) if lengths else 1
    n = len(rows)
    out: dict[str, torch.Tensor] = {}
    for key, (dtype, pad) in TOKEN_FIELDS.items():
        pad_value = pad_id if key == "input_ids" else pad
        t = torch.full((n, width), pad_value, dtype=dtype)
        for b, s in enumerate(rows):
            t[b, : lengths[b]] = torch.as_tensor(s[key], dtype=dtype)
        out[key] = t
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    adv = torch.zeros((n, width), dtype=torch.float32)
    for b, length in enumerate(lengths):
        attention_mask[b, :length] = 1
        adv[b, :length] = float(advantages[indices[b]])
    position_ids = torch.arange(width).expand(n, width).clone()
    return MicroBatch(
        attention_mask=attention_mask,
        position_ids=position_ids,
        advantages=adv,
        sample_indices=list(indices),
        **out,
    )


def make_micro_batches(
    samples: Sequence[dict[str, Any]],
    advantages: Sequence[float],
    max_tokens: int,
    pad_id: int = 0,
) -> list[MicroBatch]:
    """All samples as micro-batches of at most ``max_tokens`` padded slots each."""
    if len(advantages) != len(samples):
        raise ValueError("one advantage per sample is required")
    lengths = [validate_sample(s) for s in samples]
    return [collate(samples, group, advantages, pad_id) for group in plan_micro_batches(lengths, max_tokens)]


def plan_packs(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """First-fit decreasing: sample indices per packed micro-batch, each summing to ``<= max_tokens``.

    A sample longer than the budget is a micro-batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for b, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def pack_rows(lengths: Sequence[int], rows: str = "one", attn_weight: float = 0.0) -> tuple[list[list[int]], int]:
    """How one micro-batch's samples are laid out: ``(rows of positions into lengths, row width)``.

    ``one``: everything in one row (flash-attention's varlen path needs a single row, and then
    no attention work is wasted). ``longest``: rows as wide as the longest sample, filled first-fit
    decreasing. Attention without varlen kernels (sdpa, eager) computes a masked ``W x W`` block
    per row, so many short samples in one long row waste most of it, while one long sample among
    short ones makes ``longest`` pad a lot. ``auto`` picks the cheaper of the two by
    ``slots + attn_weight * rows * W^2`` (linear layers per slot, padding included, plus dense
    attention per row).
    """
    if rows == "one" or not lengths:
        return [list(range(len(lengths)))], sum(lengths)
    if rows not in ("longest", "auto"):
        raise ValueError(f"rows must be 'one', 'longest' or 'auto', got {rows!r}")
    width = max(lengths)
    layout = plan_packs(lengths, width)
    if rows == "auto":
        total = sum(lengths)
        one_cost = total + attn_weight * total * total
        rows_cost = len(layout) * width * (1 + attn_weight * width)
        if one_cost <= rows_cost:
            return [list(range(len(lengths)))], total
    return layout, width


def pack(
    samples: Sequence[dict[str, Any]],
    indices: Sequence[int],
    advantages: Sequence[float],
    pad_id: int = 0,
    rows: str = "one",
    attn_weight: float = 0.0,
) -> MicroBatch:
    """Concatenate the given samples into a packed :class:`MicroBatch` (see :func:`pack_rows`).

    Row-end padding continues as a sequence of its own (positions from 0, ``seq_ids`` -1,
    ``loss_mask`` 0), so it never attends to or from a sample.
    """
    chosen = [samples[i] for i in indices]
    lengths = [validate_sample(s) for s in chosen]
    layout, width = pack_rows(lengths, rows, attn_weight)
    order = [j for row in layout for j in row]  # sample_indices in layout order
    slot = {j: b for b, j in enumerate(order)}
    fields: dict[str, list[torch.Tensor]] = {k: [] for k in TOKEN_FIELDS}
    pos, seq, adv = [], [], []
    for row in layout:
        used = sum(lengths[j] for j in row)
        pad = width - used
        for key, (dtype, pad_value) in TOKEN_FIELDS.items():
            parts = [torch.as_tensor(chosen[j][key], dtype=dtype) for j in row]
            fill = pad_id if key == "input_ids" else pad_value
            parts.append(torch.full((pad,), fill, dtype=dtype))
            fields[key].append(torch.cat(parts))
        pos.append(torch.cat([torch.arange(lengths[j]) for j in row] + [torch.arange(pad)]))
        seq.append(torch.cat([torch.full((lengths[j],), slot[j], dtype=torch.long) for j in row]
                             + [torch.full((pad,), -1, dtype=torch.long)]))
        adv.append(torch.cat([torch.full((lengths[j],), float(advantages[indices[j]]), dtype=torch.float32) for j in row]
                             + [torch.zeros(pad)]))
    return MicroBatch(
        attention_mask=None,
        position_ids=torch.stack(pos),
        advantages=torch.stack(adv),
        sample_indices=[indices[j] for j in order],
        seq_ids=torch.stack(seq),
        **{k: torch.stack(v) for k, v in fields.items()},
    )


def pack_micro_batches(
    samples: Sequence[dict[str, Any]],
    advantages: Sequence[float],
    max_tokens: int,
    pad_id: int = 0,
    rows: str = "one",
    attn_weight: float = 0.0,
) -> list[MicroBatch]:
    """All samples packed into micro-batches of at most ``max_tokens`` tokens each."""
    if len(advantages) != len(samples):
        raise ValueError("one advantage per sample is required")
    lengths = [validate_sample(s) for s in samples]
    return [pack(samples, group, advantages, pad_id, rows, attn_weight) for group in plan_packs(lengths, max_tokens)]


EMPTY_TOKENS = 2  # the filler's length: the LM head needs one predicted position


def empty_micro_batch(pad_id: int = 0) -> MicroBatch:
    """A two-token packed batch with nothing to learn from (a zero-weight step).

    Under FSDP every rank must run the same number of forward and backward passes (each one
    all-gathers and reduce-scatters); a rank whose share of a minibatch has fewer micro-batches
    runs these (zero loss, zero gradient, every parameter still in the graph).
    """
    fake = {k: [pad_id if k == "input_ids" else pad] * EMPTY_TOKENS for k, (_, pad) in TOKEN_FIELDS.items()}
    fake["loss_mask"] = [0] * EMPTY_TOKENS
    mb = pack([fake], [0], [0.0], pad_id)
    mb.sample_indices = []
    return mb
