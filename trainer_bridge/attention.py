"""Attention over packed rows that never builds a dense block-diagonal mask.

A packed micro-batch holds several samples per row with ``position_ids`` restarting at 0 at
each sample (``batching.py``). transformers' sdpa/eager paths turn that into an ``L x L`` mask
per row and compute every masked score; at 8k tokens of 4 samples that is 5-7x the attention
work that is needed. The implementations here attend within each sample only:

``splice_flex``
    FlexAttention with a document block mask (CUDA): fully masked ``128 x 128`` blocks are
    skipped; the kernel is compiled (static for the first length, dynamic after).
``splice_varlen``
    ``torch.nn.attention.varlen.varlen_attn`` (CUDA, torch >= 2.10) over the samples'
    cumulative lengths; key/value heads are repeated where the installed torch has no GQA flag.
``splice_sdpa``
    one causal ``scaled_dot_product_attention`` per sample (any device; the default without
    flash-attn, and the CPU path: FlexAttention has no CPU backward, varlen no CPU kernel).

Each is registered with transformers' ``AttentionInterface`` under its name, with no mask
function, so transformers passes ``attention_mask=None`` and builds no mask at all. The sample
boundaries reach every layer as one :class:`PackedLayout` keyword (computed once per forward
by :func:`packed_layout`), which transformers forwards to the attention function unchanged and
activation checkpointing keeps for the recomputation.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

FLEX, VARLEN, SDPA = "splice_flex", "splice_varlen", "splice_sdpa"
PACKED = (FLEX, VARLEN, SDPA)
LAYOUT_KWARG = "splice_packed_layout"


@dataclass
class PackedLayout:
    """Where the samples of a ``[rows, T]`` packed batch start and end.

    ``spans``: ``(row, start, end)`` per sample (row-end padding is a span of its own);
    ``cu_seqlens``: int32 cumulative lengths over the flattened rows (varlen); ``doc_ids``:
    ``[rows, T]`` sample index per token (FlexAttention); ``block_mask``: built for ``splice_flex``.
    """

    rows: int
    width: int
    spans: list[tuple[int, int, int]]
    cu_seqlens: torch.Tensor
    max_len: int
    doc_ids: torch.Tensor
    block_mask: Any = None


def packed_layout(position_ids: torch.Tensor, implementation: str | None = None) -> PackedLayout:
    """The layout of a packed batch from its ``[rows, T]`` position ids (one host sync)."""
    if position_ids.dim() == 1:
        position_ids = position_ids.unsqueeze(0)
    rows, width = position_ids.shape
    starts = position_ids == 0
    starts[:, 0] = True  # a row always starts a sample
    doc_ids = torch.cumsum(starts.reshape(-1).to(torch.int32), 0).reshape(rows, width) - 1
    flat_starts = torch.nonzero(starts.reshape(-1)).flatten().tolist()
    bounds = flat_starts + [rows * width]
    spans = [(s // width, s % width, s % width + (e - s)) for s, e in zip(bounds[:-1], bounds[1:])]
    cu = torch.tensor(bounds, dtype=torch.int32, device=position_ids.device)
    layout = PackedLayout(rows=rows, width=width, spans=spans, cu_seqlens=cu,
                          max_len=max((e - s for _, s, e in spans), default=0), doc_ids=doc_ids)
    if implementation == FLEX:
        layout.block_mask = document_block_mask(doc_ids)
    return layout


def document_block_mask(doc_ids: torch.Tensor):
    """A FlexAttention ``BlockMask``: causal, and only within a token's own sample."""
    from torch.nn.attention.flex_attention import create_block_mask

    rows, width = doc_ids.shape

    def mask_mod(b, h, q, kv):
        return (q >= kv) & (doc_ids[b, q] == doc_ids[b, kv])

    return create_block_mask(mask_mod, rows, None, width, width, device=doc_ids.device)


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # dynamic=None: the first shape compiles static, the next ones share one dynamic-shape kernel
    # (micro-batch lengths differ from step to step)
    return torch.compile(flex_attention, dynamic=None)


def flex_attention(query, key, value, layout: PackedLayout, scale: float | None, *, compiled: bool | None = None):
    """``[rows, H, T, D]`` in and out; compiled on CUDA (eager elsewhere: a reference, slow)."""
    from torch.nn.attention.flex_attention import flex_attention as eager_flex

    block_mask = layout.block_mask if layout.block_mask is not None else document_block_mask(layout.doc_ids)
    use_compiled = query.is_cuda if compiled is None else compiled
    fn = _compiled_flex() if use_compiled else eager_flex
    gqa = query.shape[1] != key.shape[1]
    return fn(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=gqa)


def per_sample_sdpa(query, key, value, layout: PackedLayout, scale: float | None):
    """One causal SDPA per sample: ``[rows, H, T, D]`` in and out."""
    gqa = query.shape[1] != key.shape[1]
    out_rows = []
    for r in range(layout.rows):
        parts = [
            F.scaled_dot_product_attention(query[r : r + 1, :, s:e], key[r : r + 1, :, s:e], value[r : r + 1, :, s:e],
                                           is_causal=True, scale=scale, enable_gqa=gqa)
            for row, s, e in layout.spans if row == r
        ]
        out_rows.append(torch.cat(parts, dim=2) if len(parts) > 1 else parts[0])
    return torch.cat(out_rows, dim=0) if len(out_rows) > 1 else out_rows[0]


@functools.lru_cache(maxsize=1)
def _varlen():
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    return varlen_attn, "enable_gqa" in params, "is_causal" in params


def has_varlen() -> bool:
    return importlib.util.find_spec("torch.nn.attention.varlen") is not None


def varlen_attention(query, key, value, layout: PackedLayout, scale: float | None):
    """torch's varlen flash kernel over the flattened rows: ``[rows, H, T, D]`` in and out."""
    fn, has_gqa, has_is_causal = _varlen()
    rows, heads, width, dim = query.shape
    q = query.transpose(1, 2).reshape(rows * width, heads, dim)
    k = key.transpose(1, 2).reshape(rows * width, key.shape[1], dim)
    v = value.transpose(1, 2).reshape(rows * width, value.shape[1], dim)
    extra: dict[str, Any] = {}
    if heads != k.shape[1]:
        if has_gqa:
            extra["enable_gqa"] = True
        else:
            k = k.repeat_interleave(heads // k.shape[1], dim=1)
            v = v.repeat_interleave(heads // v.shape[1], dim=1)
    if has_is_causal:
        extra["is_causal"] = True
    else:
        extra["window_size"] = (-1, 0)
    cu = layout.cu_seqlens
    out = fn(q, k, v, cu, cu, layout.max_len, layout.max_len, scale=scale, **extra)
    return out.reshape(rows, width, heads, dim).transpose(1, 2)


_KERNELS = {FLEX: flex_attention, VARLEN: varlen_attention, SDPA: per_sample_sdpa}


def _make_hf_forward(name: str):
    kernel = _KERNELS[name]

    def forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                **kwargs) -> tuple[torch.Tensor, None]:
        """transformers' attention-function contract: ``[B, H, T, D]`` in, ``[B, T, H, D]`` out."""
        layout = kwargs.get(LAYOUT_KWARG)
        if layout is None:  # not called through the policy: positions alone give the same layout
            position_ids = kwargs.get("position_ids")
            if position_ids is None:
                position_ids = torch.arange(query.shape[2], device=query.device).expand(query.shape[0], -1)
            layout = packed_layout(position_ids, name)
        if attention_mask is not None:
            raise ValueError(f"{name} takes packed rows (position_ids restarting at 0), not an attention mask")
        if getattr(module, "sliding_window", None):
            raise NotImplementedError(f"{name} does not implement sliding-window attention")
        if dropout:
            raise ValueError("attention dropout is always off in the trainer")
        out = kernel(query, key, value, layout, scaling)
        return out.transpose(1, 2).contiguous(), None

    forward.__name__ = f"{name}_forward"
    # Never traced into a compiled region (``--compile-layers``): the kernel is already fused,
    # and the layout's per-sample spans would make every packing a new graph.
    return torch.compiler.disable(forward)


def register() -> None:
    """Make the implementations known to transformers (idempotent)."""
    from transformers import AttentionInterface

    for name in PACKED:
        AttentionInterface.register(name, _make_hf_forward(name))


def pick(preference: str, device: torch.device) -> str:
    """``auto``: flash-attention 2 (varlen) on CUDA when installed, else one SDPA per sample (its
    flash kernel, causal, on each sample). FlexAttention's kernel alone is faster (1.8 ms against
    2.2 ms for an 8k row of 4 samples on an H200), but in training its compiled kernel over
    changing micro-batch lengths made a 4B step 23% slower than per-sample SDPA (docs/training.md),
    so it is opt-in. ``sdpa``/``eager`` stay available (transformers' dense mask) for comparison."""
    if preference != "auto":
        return preference
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return SDPA
