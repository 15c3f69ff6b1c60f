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
    admin_token: str | None = _opt(None, "bearer token for the proxies' admin and pull API (default: $SPLICE_ADMIN_TOKEN, else the token a splice serve on this machine generated, for loopback proxies)")
    publish: bool = _opt(True, "push each step's weights to the proxies (pause -> update_weights -> resume)")
    keep_last: int | None = _opt(3, "keep only the newest N step directories ('none' keeps all)")
    checkpoint_every: int | None = _opt(
        10, "save a sharded training checkpoint (model, AdamW state, step, RNG) to <out>/checkpoints/step_{k} "
        "every N steps and after the last one ('none': never)")
    keep_checkpoints: int = _opt(1, "keep only the newest N training checkpoints")
    resume: str | None = _opt(None, "continue from this training checkpoint directory (its step + 1 up to --steps)")
    save_dtype: str | None = _opt(None, "dtype of the published weights, e.g. bfloat16 (default: the dtype the --model directory is stored in, i.e. what the engines run)")
    weight_transfer: str = _opt("auto", "how weights reach the engines: distributed (broadcast over torch.distributed "
                                "from rank 0), disk (the engines load the saved step directory) or auto (distributed "
                                "when every engine supports it)")
    export_bucket_mb: float = _opt(1024.0, "published step directory: megabytes per safetensors file (each written "
                                   "while the next is gathered)")
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
    lr_warmup_steps: int = _opt(
        0, "optimizer steps of linear learning-rate warm-up (the k-th of the first n runs at lr*k/(n+1)): "
        "AdamW's first updates are full-size sign steps of pure noise on a small batch")
    ppo_n_minibatches: int = _opt(1, "optimizer steps per training step (the batch is split in this many)")
    micro_batch_tokens: int = _opt(
        16384, "tokens per forward/backward: samples are packed up to this many (a longer sample runs alone)")
    gradient_checkpointing: bool | None = _opt(
        None, "activation checkpointing per decoder layer: recompute activations in backward "
        "(default: on with CUDA, off on CPU)")
    checkpoint_every_k_layers: int = _opt(1, "with activation checkpointing: recompute every k-th decoder layer "
                                          "only (2: half the layers keep their activations, less recompute)")
    compile_layers: bool | None = _opt(
        None, "torch.compile the parts of each decoder layer (norms, attention projections and rotary, MLP); "
        "attention kernels and checkpointing stay eager (default: on with CUDA, off on CPU)")
    optimizer_impl: str = _opt("auto", "AdamW kernel: auto (fused on CUDA, foreach on CPU), fused, foreach, for-loop")
    seed: int = _opt(0, "seed for minibatch shuffling")

    # loss (docs/design.md section 6)
    eps_clip: float = _opt(0.2, "PPO clip: ratio kept within [1 - eps_clip, 1 + eps_clip_higher]")
    eps_clip_higher: float | None = _opt(None, "upper clip (default: eps_clip)")
    c_clip: float | None = _opt(None, "dual-clip constant for negative advantages, e.g. 3.0 (default: off)")
    behav_weight: str = _opt("segment", "behaviour weight: segment (pi_{v+1}/pi_v), decoupled (pi_prox/pi_v) or off")
    behav_imp_weight_cap: float | None = _opt(5.0, "mask tokens whose behaviour weight exceeds this ('none': no cap)")
    behav_imp_weight_floor: float | None = _opt(0.2, "mask tokens whose behaviour weight is below this ('none': no floor)")
    adv_normalize_std: bool = _opt(True, "divide group-centred rewards by the group's std")
    max_staleness: int | None = _opt(
        4, "mask loss tokens sampled before version - N (a sample with none left is dropped; 'none': keep all)")
    missing_proximal: str = _opt(
        "fallback", "tokens whose pi_{v+1} recompute never happened: fallback (their behaviour weight is "
        "the decoupled pi_prox/pi_behav instead of 1), mask (not trained on) or keep (weight 1)")
    mask_missing_proximal: bool = _opt(False, "same as --missing-proximal mask")
    loss_agg: str = _opt(
        "token-mean", "loss aggregation: token-mean, seq-mean-token-sum, seq-mean-token-mean or "
        "seq-mean-token-sum-norm (token sum / --loss-norm-tokens, Dr. GRPO)")
    episode_weighting: str = _opt(
        "token", "how an episode (a session) that yields several samples is weighted under --loss-agg token-mean: "
        "token (every loss token once: an episode weighs by its tokens), episode (each episode's token mean "
        "counts once) or sample (each sample's token mean counts once); docs/samples.md")
    loss_norm_tokens: int = _opt(8192, "the constant divisor of seq-mean-token-sum-norm (e.g. the generation budget)")
    tis_cap: float | None = _opt(
        2.0, "truncated importance sampling of the engine-trainer mismatch: where the engine gave a log-prob "
        "under the weights the step starts from (tokens those weights sampled, or recomputed), the "
        "behaviour weight carries min(pi_trainer/pi_engine, CAP) ('none': off)")
    mis_low: float | None = _opt(
        0.5, "masked importance sampling: tokens whose engine-trainer ratio pi_trainer/pi_engine is below "
        "this are not trained on ('none' with --mis-high none: off)")
    mis_high: float | None = _opt(5.0, "masked importance sampling: upper end of the ratio band")
    engine_gap_cap: float | None = _opt(None, "older name of --tis-cap (overrides it when given)")

    # engine-trainer agreement gate (docs/training.md)
    agreement_max_error: float | None = _opt(
        1.1, "stop when token_mult_prob_error (mean exp|trainer - engine log-prob| on tokens with an engine "
        "value under the trainer's own weights) exceeds this for --agreement-patience steps in a row "
        "('none': never stop)")
    agreement_patience: int = _opt(3, "steps in a row past --agreement-max-error before training stops")

    # numerics
    temperature: float = _opt(1.0, "the engines' sampling temperature (log-probs are computed at it)")
    logprob_chunk_size: int = _opt(1024, "tokens per LM-head chunk in the log-prob computation")
    device: str = _opt("auto", "auto, cpu or cuda")
    model_dtype: str = _opt("float32", "master weight and AdamW state dtype (float32; bfloat16 is refused)")
    compute_dtype: str = _opt("auto", "dtype of the gathered weights in forward/backward: auto (bfloat16 on CUDA, "
                              "float32 on CPU), bfloat16 or float32")
    attn_implementation: str = _opt("auto", "attention over packed rows: auto (flash_attention_2 on CUDA when "
                                    "installed, else splice_sdpa), splice_flex "
                                    "(FlexAttention document mask), splice_varlen (torch varlen), splice_sdpa "
                                    "(one SDPA per sample), flash_attention_2; sdpa/eager build a dense mask")

    sharded_load: bool = _opt(True, "build the model on the meta device and read only this rank's shards from "
                              "the safetensors files (no rank holds the whole float32 model)")

    stats_path: str | None = _opt(None, "per-step stats JSONL (default: <out>/stats.jsonl)")
    progress: bool = _opt(True, "show a progress bar")
    log_sessions: bool = _opt(False, "list the session ids each step trained on in its stats record")

    def mis_band(self) -> tuple[float, float] | None:
        """``(mis_low, mis_high)``, None when both are off (one side off: 0 or infinity)."""
        if self.mis_low is None and self.mis_high is None:
            return None
        return (self.mis_low or 0.0, self.mis_high if self.mis_high is not None else float("inf"))

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
        self.check_dtypes()
        if self.missing_proximal not in ("fallback", "mask", "keep"):
            raise ValueError("--missing-proximal must be fallback, mask or keep")
        from .loss import LOSS_AGGS

        if self.loss_agg not in LOSS_AGGS:
            raise ValueError(f"--loss-agg must be one of {', '.join(LOSS_AGGS)}")
        if self.micro_batch_tokens < 2:
            raise ValueError("--micro-batch-tokens must be >= 2")
        if self.episode_weighting not in ("token", "episode", "sample"):
            raise ValueError("--episode-weighting must be token, episode or sample")
        if self.episode_weighting != "token" and self.loss_agg != "token-mean":
            raise ValueError("--episode-weighting episode|sample reweights a token mean: use it with --loss-agg token-mean")
        band = self.mis_band()
        if band is not None and not (0 <= band[0] < 1 < band[1]):
            raise ValueError(f"--mis-low / --mis-high must satisfy 0 <= low < 1 < high, got {band}")
        if self.tis_cap is not None and self.tis_cap <= 1:
            raise ValueError("--tis-cap must be > 1 (or 'none')")
        if self.agreement_max_error is not None and self.agreement_max_error <= 1:
            raise ValueError("--agreement-max-error must be > 1 (token_mult_prob_error is 1 when engine and trainer agree)")
        if self.agreement_patience < 1:
            raise ValueError("--agreement-patience must be >= 1")
        return self

    def check_dtypes(self) -> None:
        """Refuse pure low-precision AdamW: it would silently not train."""
        if self.model_dtype in ("bfloat16", "float16"):
            raise ValueError(
                f"--model-dtype {self.model_dtype} would run AdamW on {self.model_dtype} weights with no float32 "
                "master copy: at a learning rate like 1e-6 almost every update rounds away and the model silently "
                "does not train. Keep --model-dtype float32 (the default); on GPU the forward and backward already "
                "run in bfloat16 (--compute-dtype auto) while the sharded master weights and AdamW state stay float32."
            )
        if self.model_dtype not in ("float32", "float64"):
            raise ValueError("--model-dtype must be float32 (or float64)")
        if self.compute_dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError("--compute-dtype must be auto, bfloat16 or float32")

    @property
    def missing_proximal_mode(self) -> str:
        return "mask" if self.mask_missing_proximal else self.missing_proximal


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
        "Several GPUs (FSDP2): torchrun --nproc-per-node N -m trainer_bridge.train ... (docs/training.md).",
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
