"""Pack pulled samples into right-padded micro-batches under a token budget.

Each sample is one row: no attention across samples, ``position_ids`` restart at 0 per row, and
padding has ``attention_mask`` 0 and ``loss_mask`` 0. Every per-token array of the pull API is
padded the same way, so index ``[b, i]`` of every tensor describes the same token (docs/design.md section 2).

The budget counts padded slots (rows x longest row), the memory the forward pass really uses.
Rows are sorted longest-first before packing so similar lengths share a micro-batch.
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
    """Tensors ``[rows, T]`` in token coordinates; ``sample_indices[b]`` is row ``b``'s sample."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    logprobs: torch.Tensor
    versions: torch.Tensor
    proximal_logprobs_t: torch.Tensor
    proximal_versions: torch.Tensor
    advantages: torch.Tensor
    sample_indices: list[int]
    proximal_logprobs: torch.Tensor | None = field(default=None)  # filled in by the trainer

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


def empty_micro_batch(pad_id: int = 0) -> MicroBatch:
    """A one-token batch with nothing to learn from.

    Under DDP every rank must run the same number of synchronizing backward passes; a rank whose
    shard of a minibatch is empty runs this one (zero loss, zero gradient).
    """
    fake = {k: [pad_id if k == "input_ids" else pad] for k, (_, pad) in TOKEN_FIELDS.items()}
    fake["loss_mask"] = [0]
    return collate([fake], [0], [0.0], pad_id)
