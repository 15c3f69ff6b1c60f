"""Build the sharded policy without any rank holding the whole float32 model in host memory.

``from_pretrained`` on every rank, then ``fully_shard``, costs every rank the full float32 model
while starting (8 ranks x 32 GB for an 8B model). Instead each rank:

1. builds the model on the ``meta`` device (parameters only: buffers such as rotary
   frequencies are small and computed for real), wraps it in the policy and shards it;
2. allocates only its own shards (``to_empty`` on its device);
3. reads each shard's rows straight from the safetensors files (``get_slice``: a memory map,
   only the rows this rank owns are touched), converting to the master dtype on the way.

A model whose checkpoint names differ from its module names (a vision model's converted keys)
falls back to ``from_pretrained`` then sharding (:func:`checkpoint_keys_match`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside register their parameters on ``meta``; buffers stay real."""
    original = nn.Module.register_parameter

    def register(module, name, param):
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            current = module._parameters[name]
            kwargs = {**current.__dict__, "requires_grad": current.requires_grad}
            module._parameters[name] = type(current)(current.to("meta"), **kwargs)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def checkpoint_index(model_dir: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    from safetensors import safe_open

    folder = Path(model_dir)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: folder / f for k, f in weight_map.items()}
    out: dict[str, Path] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            out.update({k: f for k in fh.keys()})
    return out


def _source_key(name: str, keys: dict[str, Path], model: nn.Module) -> str | None:
    if name in keys:
        return name
    if getattr(model.config, "tie_word_embeddings", False):  # a tied head saved only as the embedding
        out_emb, in_emb = model.get_output_embeddings(), model.get_input_embeddings()
        if out_emb is not None and in_emb is not None and name.startswith(_module_name(model, out_emb)):
            alt = _module_name(model, in_emb) + name[len(_module_name(model, out_emb)):]
            if alt in keys:
                return alt
    return None


def _module_name(model: nn.Module, module: nn.Module) -> str:
    for n, m in model.named_modules():
        if m is module:
            return n
    raise KeyError("module not in model")


def checkpoint_keys_match(model: nn.Module, keys: dict[str, Path]) -> bool:
    """Every parameter of ``model`` is found in the checkpoint under its own name."""
    return all(_source_key(n, keys, model) is not None for n, _ in model.named_parameters())


def build_meta_model(model_dir: str, *, attn_implementation: str | None):
    """The causal LM of ``model_dir`` with float32 parameters on ``meta``, real buffers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with parameters_on_meta():
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **extra)
        except TypeError:  # transformers < 4.56 spells it torch_dtype
            model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32, **extra)
    return model


def materialize(root: nn.Module, device: torch.device) -> None:
    """Allocate this rank's shards of a meta-built (and sharded) ``root`` on ``device``; the real
    buffers are carried over (``to_empty`` would leave them uninitialised)."""
    buffers = {name: b.detach().clone() for name, b in root.named_buffers()}
    root.to_empty(device=device)
    with torch.no_grad():
        for name, b in root.named_buffers():
            if name in buffers:
                b.copy_(buffers[name].to(device))


def load_shards(model: nn.Module, model_dir: str | Path, keys: dict[str, Path] | None = None) -> int:
    """Copy each parameter's local shard (FSDP2 ``Shard(0)``: a row range) from the safetensors
    files; returns the bytes read. Works on plain tensors too (the whole tensor is the shard)."""
    from safetensors import safe_open

    keys = keys if keys is not None else checkpoint_index(model_dir)
    by_file: dict[Path, list[tuple[str, nn.Parameter]]] = {}
    for name, p in model.named_parameters():
        key = _source_key(name, keys, model)
        if key is None:
            raise KeyError(f"{name} is not in the checkpoint of {model_dir}")
        by_file.setdefault(keys[key], []).append((key, p))
    read = 0
    with torch.no_grad():
        for path, params in by_file.items():
            with safe_open(str(path), framework="pt") as fh:
                for key, p in params:
                    local, offset = _local_shard(p)
                    if local.numel() == 0:
                        continue
                    rows = slice(offset, offset + local.shape[0]) if local.dim() else None
                    piece = fh.get_slice(key)
                    t = piece[rows] if rows is not None else piece[:]
                    local.copy_(t.to(local.dtype))
                    read += t.numel() * t.element_size()
                    del t
    return read


def _local_shard(p: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(the local tensor, its first row in the full tensor)``."""
    data = p.data if isinstance(p, nn.Parameter) else p
    if hasattr(data, "to_local"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(data.shape, data.device_mesh, data.placements)
        local = data.to_local()
        assert tuple(local.shape) == tuple(shape), (local.shape, shape)
        if any(o for o in offset[1:]):
            raise NotImplementedError("only row (dim 0) sharding is supported")
        return local, int(offset[0]) if offset else 0
    return data, 0
