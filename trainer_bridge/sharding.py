"""FSDP2 for the policy: every decoder layer and the root sharded over all ranks.

One code path for any world size (a single process has a one-rank group). Parameters stay
float32 *master* weights, sharded, and so does AdamW's state (``exp_avg``, ``exp_avg_sq``), so a
rank holds ``16 bytes x params / world_size`` of training state. On GPU the all-gathered copies
used for compute are bfloat16 (``MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32)``: gradients are reduced in float32 into the float32 shards); on CPU
everything is float32.

Decoder layers are found through transformers' ``_no_split_modules`` (the classes a model must
not be split inside, e.g. ``Qwen3DecoderLayer``); the root is the :class:`~.policy.Policy`, so
the embedding, final norm and LM head are all-gathered in its forward, where the chunked
log-prob head reads them.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from .distributed import Dist


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks, by transformers' ``_no_split_modules`` class names."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:  # fall back to the usual ``model.layers`` ModuleList
        body = getattr(model, "base_model", model)
        layers = list(getattr(body, "layers", []))
    return layers


def shard_policy(policy: nn.Module, dist: Dist, *, param_dtype: torch.dtype | None = None) -> nn.Module:
    """``fully_shard`` each decoder layer, then the policy (root), over a 1-D mesh of all ranks.

    ``param_dtype``: the compute dtype of the all-gathered parameters (None: as stored, float32);
    gradients are always reduced in float32.
    """
    mesh = init_device_mesh(dist.device.type, (dist.world_size,))
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in decoder_layers(policy.model):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(policy, mesh=mesh, mp_policy=mp)
    return policy


def local_bytes(tensors) -> int:
    """Bytes this rank holds for ``tensors`` (a DTensor counts only its local shard)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state (from the local shards)."""
    params = list(module.parameters())
    opt = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {
        "param_bytes": local_bytes(params),
        "grad_bytes": local_bytes(p.grad for p in params),
        "optim_bytes": local_bytes(opt),
    }
