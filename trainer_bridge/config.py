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


def _opt(default: Any, help: str) -> Any:
    """A config field with its ``--help`` text."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    # where samples come from and weights go
    proxies: list[str] = _opt([], "proxy base URL (repeat for several proxies)")
    model: str = _opt("", "local HF model directory (safetensors) the engines serve at the start")
    out: str = _opt("splice_train", "output directory: step_{k} weight directories and stats.jsonl")
    admin_token: str | None = _opt(None, "bearer token for the proxies' admin and pull API")
    publish: bool = _opt(True, "push each step's weights to the proxies (pause -> update_weights -> resume)")
    keep_last: int | None = _opt(3, "keep only the newest N step directories ('none' keeps all)")
    save_dtype: str | None = _opt(None, "cast weights when saving, e.g. bfloat16 (default: as trained)")
    weight_transfer: str = _opt("auto", "how weights reach the engines: distributed (broadcast over torch.distributed "
                                "from rank 0), disk (the engines load the saved step directory) or auto (distributed "
                                "when every engine supports it)")
    bucket_mb: float = _opt(512.0, "distributed weight transfer: megabytes of tensors per update call")
    master_address: str = _opt("127.0.0.1", "distributed weight transfer: the address the engines reach this trainer at")

    # schedule
    steps: int = _opt(1, "training steps (one pull batch, one published version each)")
    batch_samples: int = _opt(8, "samples leased per pull")
    min_samples: int = _opt(1, "pull again until a step has at least this many trainable samples")
    pull_wait_s: float = _opt(30.0, "long-poll time of one pull")
    pull_timeout_s: float | None = _opt(None, "stop training when a step found nothing trainable for this long")

    # optimization
    lr: float = _opt(1e-6, "AdamW learning rate")
    weight_decay: float = _opt(0.0, "AdamW weight decay")
    adam_beta1: float = _opt(0.9, "AdamW beta1")
    adam_beta2: float = _opt(0.999, "AdamW beta2")
    adam_eps: float = _opt(1e-8, "AdamW epsilon")
    max_grad_norm: float | None = _opt(1.0, "gradient clipping norm ('none' disables)")
    ppo_n_minibatches: int = _opt(1, "optimizer steps per training step (the batch is split in this many)")
    micro_batch_tokens: int = _opt(8192, "padded tokens per forward/backward (gradient accumulation unit)")
    gradient_checkpointing: bool = _opt(False, "recompute decoder activations in backward to save memory")
    seed: int = _opt(0, "seed for minibatch shuffling")

    # loss (docs/design.md section 6)
    eps_clip: float = _opt(0.2, "PPO clip: ratio kept within [1 - eps_clip, 1 + eps_clip_higher]")
    eps_clip_higher: float | None = _opt(None, "upper clip (default: eps_clip)")
    c_clip: float | None = _opt(None, "dual-clip constant for negative advantages, e.g. 3.0 (default: off)")
    behav_weight: str = _opt("segment", "behaviour weight: segment (pi_{v+1}/pi_v), decoupled (pi_prox/pi_v) or off")
    behav_imp_weight_cap: float | None = _opt(5.0, "mask tokens whose behaviour weight exceeds this ('none': no cap)")
    behav_imp_weight_floor: float | None = _opt(0.2, "mask tokens whose behaviour weight is below this ('none': no floor)")
    adv_normalize_std: bool = _opt(True, "divide group-centred rewards by the group's std")
    max_staleness: int | None = _opt(4, "drop samples with a token older than version - N ('none': keep all)")
    mask_missing_proximal: bool = _opt(False, "mask tokens whose pi_{v+1} recompute never happened")

    # numerics
    temperature: float = _opt(1.0, "the engines' sampling temperature (log-probs are computed at it)")
    logprob_chunk_size: int = _opt(1024, "tokens per LM-head chunk in the log-prob computation")
    device: str = _opt("auto", "auto, cpu or cuda")
    model_dtype: str = _opt("float32", "parameter dtype (bf16 autocast is used on CUDA regardless)")

    stats_path: str | None = _opt(None, "per-step stats JSONL (default: <out>/stats.jsonl)")
    progress: bool = _opt(True, "show a progress bar")
    log_sessions: bool = _opt(False, "list the session ids each step trained on in its stats record")

    def validate(self) -> "TrainConfig":
        if not self.proxies:
            raise ValueError("at least one --proxy URL is required")
        if not self.model:
            raise ValueError("--model DIR is required")
        if self.weight_transfer not in ("auto", "distributed", "disk"):
            raise ValueError(f"--weight-transfer must be auto, distributed or disk, got {self.weight_transfer!r}")
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
        prog="splice train",
        description="GRPO / decoupled-PPO trainer that learns from Splice proxies.",
        epilog="Every flag can also be set as SPLICE_TRAIN_<FLAG> (e.g. SPLICE_TRAIN_LR=1e-6; "
        "SPLICE_TRAIN_PROXIES takes a comma-separated list); SPLICE_ADMIN_TOKEN sets the admin token. "
        "Data-parallel: torchrun --nproc_per_node N -m trainer_bridge.train ...",
    )
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        kind, optional = _base_type(hints[f.name])
        flag = _flag(f.name)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        text = f.metadata.get("help", "") + ("" if default in ("", [], None) else f" (default: {default})")
        if kind is list:
            parser.add_argument(flag, dest=f.name, action="append", default=argparse.SUPPRESS, metavar="URL", help=text)
        elif kind is bool:
            parser.add_argument(
                flag, dest=f.name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=text
            )
        else:
            parse = _parse_optional(kind) if optional else kind
            metavar = f.name.split("_")[-1].upper() if kind is str else kind.__name__.upper()
            parser.add_argument(flag, dest=f.name, type=parse, default=argparse.SUPPRESS, metavar=metavar, help=text)
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
