"""The published weights: gathered from the FSDP2 shards in the engines' dtype, written bucket by bucket.

Every rank runs :func:`engine_tensors` (each gather is a collective); rank 0 alone keeps the
tensors. Each shard is cast to the engine dtype *on its device* before the all-gather, so a
bfloat16 engine costs half the traffic and half the host memory of gathering float32 masters.
:func:`save_engine_dir` then writes them as HF safetensors files of about ``bucket_mb`` each
while the next bucket is gathered (a few writer threads), plus ``config.json`` and the tokenizer
files. Parameters come from ``named_parameters()``, which lists a tied head once (as the
embedding, as transformers itself saves it), so the tensor set is the same at every world size
and on every device.
"""

from __future__ import annotations

import copy
import json
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from . import distributed
from .distributed import Dist


def _named_weights(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters (a tied one once) and persistent buffers, in the model's own names."""
    out = [(n, p) for n, p in model.named_parameters()]
    for n, b in model.named_buffers():
        owner, _, attr = n.rpartition(".")
        if attr not in model.get_submodule(owner)._non_persistent_buffers_set:
            out.append((n, b))
    return out


def engine_tensors(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` per weight, on the parameters' device, cast to ``dtype`` before
    gathering. A collective: every rank iterates it to the end, in the same order."""
    for name, t in _named_weights(model):
        t = t.detach()
        if hasattr(t, "to_local"):
            from torch.distributed.tensor import DTensor

            local = t.to_local()
            if dtype is not None and local.is_floating_point() and local.dtype != dtype:
                local = local.to(dtype)
            t = DTensor.from_local(local, t.device_mesh, t.placements, shape=t.shape, stride=t.stride()).full_tensor()
        elif dtype is not None and t.is_floating_point() and t.dtype != dtype:
            t = t.to(dtype)
        yield name, t


def plan_buckets(model: nn.Module, dtype: torch.dtype | None, bucket_bytes: int) -> list[list[str]]:
    """Weight names grouped into consecutive buckets of about ``bucket_bytes`` (known up front,
    so the files can be named ``model-0000k-of-0000n``)."""
    buckets: list[list[str]] = [[]]
    size = 0
    for name, t in _named_weights(model):
        itemsize = (torch.empty((), dtype=dtype).element_size() if dtype is not None and t.is_floating_point()
                    else t.element_size())
        nbytes = t.numel() * itemsize
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(name)
        size += nbytes
    return buckets


@dataclass
class ExportReport:
    path: str
    bytes: int = 0
    files: int = 0
    tensors: int = 0
    gather_s: float = 0.0  # gathering, casting and copying to the host (rank 0's view; writes overlap)
    total_s: float = 0.0
    names: list[str] = field(default_factory=list)


def save_engine_dir(model: nn.Module, dist: Dist, src_dir: str | None, out_dir: str | Path, *,
                    dtype: str | torch.dtype | None = None, bucket_mb: float = 1024.0,
                    writers: int = 4) -> ExportReport:
    """Collective: write ``model`` (an HF causal LM, sharded or not) as an HF folder at ``out_dir``
    (rank 0), written to a temporary sibling and renamed, so an engine never loads half of it.
    Any failure on rank 0 is raised on every rank, after every rank has finished its gathers."""
    start = time.perf_counter()
    target = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    out = Path(out_dir).absolute()
    tmp = out.with_name(f".{out.name}.tmp")
    report = ExportReport(path=str(out))
    buckets = plan_buckets(model, target, int(bucket_mb * 2**20))
    n_files = len(buckets)
    error: BaseException | None = None
    pool = ThreadPoolExecutor(max_workers=max(1, writers)) if dist.is_main else None
    pending: list[Future] = []
    weight_map: dict[str, str] = {}
    if dist.is_main:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        except OSError as e:
            error = e
    current: dict[str, torch.Tensor] = {}
    index = 0
    source: torch.device | None = None  # the GPU the asynchronous host copies come from
    try:
        # every rank runs every gather, whatever went wrong on rank 0 (the others would hang)
        t0 = time.perf_counter()
        for name, t in engine_tensors(model, target):
            last_of_bucket = name == buckets[index][-1]
            if dist.is_main and error is None:
                try:
                    current[name] = _to_host(t)
                    if t.is_cuda:
                        source = t.device
                    if last_of_bucket and source is not None:
                        torch.cuda.current_stream(source).synchronize()  # the bucket's copies have landed
                except BaseException as e:  # noqa: BLE001 - raised on every rank after the gathers
                    error = e
            del t
            report.gather_s += time.perf_counter() - t0
            if last_of_bucket:
                if dist.is_main and error is None:
                    fname = f"model-{index + 1:05d}-of-{n_files:05d}.safetensors" if n_files > 1 else "model.safetensors"
                    weight_map.update({k: fname for k in current})
                    report.bytes += sum(v.numel() * v.element_size() for v in current.values())
                    pending.append(pool.submit(_write, current, tmp / fname))
                    while len(pending) > writers:  # bounded host memory: at most writers + 1 buckets
                        error = error or _result(pending.pop(0))
                current = {}
                index += 1
            t0 = time.perf_counter()
        if dist.is_main:
            for f in pending:
                error = error or _result(f)
            if error is None:
                _write_meta(model, src_dir, tmp, target, weight_map, report.bytes, n_files)
                shutil.rmtree(out, ignore_errors=True)
                tmp.rename(out)
                report.files, report.tensors, report.names = n_files, len(weight_map), sorted(weight_map)
    except BaseException as e:  # noqa: BLE001 - a failed gather fails on every rank; re-raised below
        error = error or e
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
    report.total_s = time.perf_counter() - start

    def check() -> ExportReport:
        if error is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            raise error
        return report

    return distributed.on_main(dist, check)


def _result(f: Future) -> BaseException | None:
    try:
        f.result()
        return None
    except BaseException as e:  # noqa: BLE001
        return e


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t``. From a GPU, into pinned memory and asynchronously on the device's
    current stream: the next tensor is gathered meanwhile, and the caller waits once per bucket,
    before a writer reads it. A pageable copy goes through the driver's staging buffer at a
    fraction of the bus's speed, one blocking copy at a time. Pinned blocks come from torch's
    caching host allocator, so later publishes reuse them."""
    if t.device.type != "cuda":
        return t.to("cpu", copy=True, memory_format=torch.contiguous_format)
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def _write(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})


def _write_meta(model: nn.Module, src_dir: str | None, folder: Path, dtype: torch.dtype | None,
                weight_map: dict[str, str], total: int, n_files: int) -> None:
    """``config.json`` (in the written dtype), the generation config, the index of a multi-file
    folder, and the tokenizer/processor files from ``src_dir``."""
    from .policy import TOKENIZER_FILES

    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    if dtype is not None:
        setattr(config, "dtype" if hasattr(config, "dtype") else "torch_dtype", dtype)
    config.save_pretrained(folder)
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        try:
            generation.save_pretrained(folder)
        except Exception:  # noqa: BLE001 - a generation config that does not validate is not needed to serve
            pass
    if n_files > 1:
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    if src_dir is not None:
        for name in TOKENIZER_FILES:
            src = Path(src_dir) / name
            if src.is_file() and not (folder / name).exists():
                shutil.copy2(src, folder / name)
