"""What a weight transfer over ``torch.distributed`` tells an engine, and the exact request
bodies SGLang and vLLM take for it (docs/engines.md, "Weights over torch.distributed").

The trainer is rank 0 of a process group; the engine joins at ``rank_offset`` and receives one
broadcast per named tensor. Splice gives each engine a group of its own (the trainer and the
engine's ranks: ``world_size`` 1 + its GPUs, ``rank_offset`` 1), so one engine failing or
restarting never touches another's transfer.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WeightGroup:
    """A process group to join: the trainer listens on ``master_address:master_port``."""

    master_address: str
    master_port: int
    group_name: str
    backend: str = "nccl"
    rank_offset: int = 1
    world_size: int = 2


@dataclass(frozen=True)
class TensorBatch:
    """One bucket of a broadcast: the tensors in the order the trainer sends them.
    ``first`` / ``final``: the first and the last bucket of a publish (vLLM opens and closes
    its update around them; the final one stamps the version)."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]  # torch dtype names: "bfloat16", "float32", ...
    shapes: tuple[tuple[int, ...], ...]
    group_name: str
    version: int
    first: bool = True
    final: bool = True


def sglang_init_body(g: WeightGroup) -> dict:
    """``POST /init_weights_update_group`` (``InitWeightsUpdateGroupReqInput``)."""
    return {
        "master_address": g.master_address,
        "master_port": int(g.master_port),
        "rank_offset": int(g.rank_offset),
        "world_size": int(g.world_size),
        "group_name": g.group_name,
        "backend": g.backend,
    }


def sglang_update_body(b: TensorBatch) -> dict:
    """``POST /update_weights_from_distributed`` (``UpdateWeightsFromDistributedReqInput``): the
    version is stamped with the final bucket only, so an engine whose transfer stopped half way
    still reports the version it had."""
    return {
        "names": list(b.names),
        "dtypes": list(b.dtypes),
        "shapes": [list(s) for s in b.shapes],
        "group_name": b.group_name,
        "flush_cache": bool(b.final),
        "weight_version": str(int(b.version)) if b.final else None,
    }


def vllm_init_body(g: WeightGroup) -> dict:
    """``POST /init_weight_transfer_engine`` ``{"init_info": NCCLWeightTransferInitInfo}``
    (vLLM 0.32, ``--weight-transfer-config '{"backend": "nccl"}'``): unpacked, one broadcast
    per tensor, as the SGLang path sends them."""
    return {
        "init_info": {
            "master_address": g.master_address,
            "master_port": int(g.master_port),
            "rank_offset": int(g.rank_offset),
            "world_size": int(g.world_size),
            "packed": False,
        }
    }


def vllm_update_body(b: TensorBatch) -> dict:
    """``POST /update_weights`` ``{"update_info": NCCLWeightTransferUpdateInfo}``."""
    return {"update_info": {"names": list(b.names), "dtype_names": list(b.dtypes), "shapes": [list(s) for s in b.shapes]}}


def vllm_finish_body(b: TensorBatch) -> dict:
    """``POST /finish_weight_update`` ``{"weight_version"}``: vLLM sets the version read back
    from ``/weight_info``."""
    return {"weight_version": str(int(b.version))}
