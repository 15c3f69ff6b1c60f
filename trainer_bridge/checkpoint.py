"""Sharded training checkpoints: model + AdamW state + step + RNG, via torch.distributed.checkpoint.

Each rank writes its own shards (no gather onto one rank), so a checkpoint of a 32B model is
written in parallel and never has to fit in one process. ``trainer.json`` holds the step and
the world size it was written at; ``rng_rank{r}.pt`` each rank's RNG states. DCP reshards on
load, so a checkpoint may be resumed at another world size (the step's sample plan then
differs, so only a same-size resume reproduces the uninterrupted run bit for bit).

Written to a temporary sibling and renamed once every rank is done, so a crash mid-save never
leaves a directory that looks complete.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from .distributed import Dist

STATE_FILE = "trainer.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def _rng_state(device: torch.device) -> dict[str, Any]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def save_checkpoint(module: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str | Path, dist: Dist,
                    state: dict[str, Any]) -> Path:
    """Collective: every rank calls it. ``state`` (JSON-able, e.g. the step) goes to ``trainer.json``."""
    path = Path(path).absolute()
    tmp = path.with_name(f".{path.name}.tmp")
    if dist.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    torch_dist.barrier()
    model_sd, optim_sd = get_state_dict(module, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    torch.save(_rng_state(dist.device), tmp / f"rng_rank{dist.rank}.pt")
    torch_dist.barrier()
    if dist.is_main:
        (tmp / STATE_FILE).write_text(json.dumps({**state, "world_size": dist.world_size}))
        shutil.rmtree(path, ignore_errors=True)
        tmp.rename(path)
    torch_dist.barrier()
    return path


def load_checkpoint(module: torch.nn.Module, optimizer: torch.optim.Optimizer, path: str | Path, dist: Dist) -> dict[str, Any]:
    """Collective: load the shards into ``module``/``optimizer`` in place; return ``trainer.json``."""
    path = Path(path).absolute()
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"{path} is not a training checkpoint (no {STATE_FILE})")
    model_sd, optim_sd = get_state_dict(module, optimizer)
    sd = {"model": model_sd, "optim": optim_sd}
    dcp.load(sd, checkpoint_id=str(path))
    set_state_dict(module, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    rng = path / f"rng_rank{dist.rank}.pt"
    if rng.is_file():
        states = torch.load(rng, weights_only=False)
        torch.set_rng_state(states["cpu"])
        if "cuda" in states and dist.device.type == "cuda":
            torch.cuda.set_rng_state(states["cuda"], dist.device)
    return json.loads((path / STATE_FILE).read_text())


def prune_checkpoints(root: Path, keep: int) -> None:
    """Keep the newest ``keep`` ``step_{k}`` checkpoints under ``root``."""
    if not root.is_dir():
        return
    steps = sorted((int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name)))
    for _, p in steps[: max(0, len(steps) - max(keep, 1))]:
        shutil.rmtree(p, ignore_errors=True)
