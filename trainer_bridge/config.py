"""Trainer configuration: one dataclass, and the ``splice train`` command line built from it.

Every field is a CLI flag (``batch_samples`` -> ``--batch-samples``); list fields repeat
(``--proxy URL --proxy URL2``) and booleans come as ``--flag`` / ``--no-flag``. Unset flags fall
back to ``SPLICE_TRAIN_<FIELD>`` environment variables (``SPLICE_ADMIN_TOKEN`` also works for
the admin token), then to the defaults below.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrainConfig:
    # where samples come from and weights go
    proxies: list[str] = field(default_factory=list)  # proxy base URLs (flag: --proxy, repeatable)
    model: str = ""  # local HF model directory (safetensors) the engines serve at the start
    out: str = "splice_train"  # step_{k} weight directories and stats.jsonl go here
    admin_token: str | None = None
    publish: bool = True  # push each step's weights to the proxies (pause -> update -> resume)
    keep_last: int | None = 3  # delete older step_{k} directories (None keeps all)
    save_dtype: str | None = None  # e.g. bfloat16: cast weights when saving (None: as trained)

    # schedule
    steps: int = 1
    batch_samples: int = 8  # samples leased per pull
    min_samples: int = 1  # pull again until a step has at least this many trainable samples
    pull_wait_s: float = 30.0  # long-poll time of one pull
    pull_timeout_s: float | None = None  # give up a step after waiting this long (None: forever)

    # optimization
    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    max_grad_norm: float | None = 1.0
    ppo_n_minibatches: int = 1  # optimizer steps per training step
    micro_batch_tokens: int = 8192  # padded tokens per forward/backward
    gradient_checkpointing: bool = False
    seed: int = 0

    # loss (SPEC section 6)
    eps_clip: float = 0.2
    eps_clip_higher: float | None = None
    c_clip: float | None = None  # dual clip, e.g. 3.0
    behav_weight: str = "segment"  # segment | decoupled | off
    behav_imp_weight_cap: float | None = 5.0
    behav_imp_weight_floor: float | None = 0.2
    adv_normalize_std: bool = True
    max_staleness: int | None = 4  # drop samples with a token older than version - max_staleness
    mask_missing_proximal: bool = False  # mask tokens whose pi_{v+1} recompute never happened

    # numerics
    temperature: float = 1.0  # the engines' sampling temperature
    logprob_chunk_size: int = 1024
    device: str = "auto"  # auto | cpu | cuda
    model_dtype: str = "float32"  # parameter dtype (bf16 autocast is added on CUDA anyway)

    stats_path: str | None = None  # default: <out>/stats.jsonl
    progress: bool = True

    def validate(self) -> "TrainConfig":
        if not self.proxies:
            raise ValueError("at least one --proxy URL is required")
        if not self.model:
            raise ValueError("--model DIR is required")
        if self.behav_weight not in ("segment", "decoupled", "off"):
            raise ValueError("--behav-weight must be segment, decoupled or off")
        if self.ppo_n_minibatches < 1 or self.steps < 0 or self.batch_samples < 1:
            raise ValueError("--ppo-n-minibatches and --batch-samples must be >= 1, --steps >= 0")
        return self


_FLAG_NAMES = {"proxies": "proxy"}


def _flag(name: str) -> str:
    return "--" + _FLAG_NAMES.get(name, name).replace("_", "-")


def _base_type(tp: Any) -> tuple[type, bool]:
    """(scalar type, optional?) of a field annotation such as ``float | None``."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    optional = type(None) in typing.get_args(tp)
    if typing.get_origin(tp) is list:
        return list, False
    return (args[0] if args else tp), optional


def _parse_optional(kind: type):
    def parse(text: str):
        return None if text.lower() in ("none", "null", "") else kind(text)

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splice train", description="GRPO / decoupled-PPO trainer that learns from Splice proxies."
    )
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        kind, optional = _base_type(hints[f.name])
        flag = _flag(f.name)
        if kind is list:
            parser.add_argument(flag, dest=f.name, action="append", default=argparse.SUPPRESS, metavar="URL")
        elif kind is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS)
        else:
            parse = _parse_optional(kind) if optional else kind
            parser.add_argument(flag, dest=f.name, type=parse, default=argparse.SUPPRESS)
    return parser


def _from_env(name: str, kind: type, optional: bool) -> Any:
    value = os.environ.get(f"SPLICE_TRAIN_{name.upper()}")
    if value is None and name == "admin_token":
        value = os.environ.get("SPLICE_ADMIN_TOKEN")
    if value is None:
        return None
    if kind is list:
        return [v for v in value.split(",") if v]
    if kind is bool:
        return value.lower() in ("1", "true", "yes", "on")
    return _parse_optional(kind)(value) if optional else kind(value)


def config_from_argv(argv: list[str] | None = None) -> TrainConfig:
    args = vars(build_parser().parse_args(argv))
    hints = typing.get_type_hints(TrainConfig)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(TrainConfig):
        if f.name in args:
            values[f.name] = args[f.name]
        else:
            env = _from_env(f.name, *_base_type(hints[f.name]))
            if env is not None:
                values[f.name] = env
    return TrainConfig(**values).validate()
