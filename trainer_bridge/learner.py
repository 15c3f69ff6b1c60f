"""The learner: the FSDP2-sharded policy, its AdamW, and one training step on it.

One step on every rank:

1. rank 0 plans the step (``plan.py``) and sends each rank only its share of the samples;
2. *proximal pass*: the share's log-probs under the start-of-step weights, no grad. This is
   ``logp_prox`` of the loss, so the PPO ratio on the first minibatch is exactly 1. With a
   single minibatch the ratio is identically 1 and the pass is skipped: the training forward's
   own log-probs (detached) are the proximal values;
3. ``ppo_n_minibatches`` optimizer steps; each accumulates gradients over the rank's packed
   micro-batches (every rank runs the same number; fillers have zero weight), normalized by the
   minibatch's count over all ranks (a global token mean, or a global sample mean for the
   ``seq-mean-*`` aggregations), however the samples are split over micro-batches and ranks.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import attention, distributed, loading
from .balance import attention_weight
from .batching import MicroBatch, empty_micro_batch, pack
from .config import TrainConfig
from .distributed import Dist
from .loss import decoupled_ppo_loss, stats_to_floats
from .plan import RankShare, plan_step
from .policy import Policy, load_causal_lm, packed_attention_for, pick_attn_implementation, prepare_for_training
from .sharding import decoder_layers, shard_policy
from .stats import StatsAccumulator
from .vision import PixelCache, VisionSettings, batch_pixels, packed_rope_positions


@dataclass
class Learner:
    """The sharded model and its optimizer. ``module`` is ``policy`` (the FSDP2 root)."""

    policy: Policy
    module: nn.Module
    optimizer: Any
    dist: Dist
    attn_weight: float = 0.0
    pack_rows: str = "one"  # micro-batch layout (batching.pack_rows): one row for flash-attention varlen, else auto
    vision: VisionSettings | None = None  # a Qwen2.5-VL policy: its image-processor settings and banned ids
    pixels: PixelCache | None = None  # processed pixels per image hash (this rank's)


def compute_dtype(config: TrainConfig, device: torch.device) -> torch.dtype | None:
    """The dtype FSDP all-gathers parameters in (None: as stored)."""
    if config.compute_dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    return None if config.compute_dtype == "float32" else getattr(torch, config.compute_dtype)


def activation_checkpointing(config: TrainConfig, device: torch.device) -> bool:
    return device.type == "cuda" if config.gradient_checkpointing is None else config.gradient_checkpointing


def compiled_layers(config: TrainConfig, device: torch.device) -> bool:
    """On by default with CUDA: it fuses the memory-bound work around the GEMMs (4B on an H200:
    8,565 -> 11,809 tokens/s, docs/training.md). Off on CPU, where compiling costs more than it
    saves. Triton builds its kernel launchers with a C compiler, which CUDA "runtime" images lack:
    there the default is eager, said once on stderr, rather than a crash in the first step."""
    if config.compile_layers is not None:
        return config.compile_layers
    if device.type != "cuda":
        return False
    if c_compiler() is None:
        _say_no_compiler()
        return False
    return True


@functools.cache
def _say_no_compiler() -> None:
    print("warning: no C compiler for Triton ($CC, gcc or clang): the decoder layers run eagerly, about "
          "1.4x slower at 4B; install gcc (build-essential), or pass --compile-layers to try anyway", file=sys.stderr)


def c_compiler() -> str | None:
    """The compiler Triton would use: ``$CC``, else gcc, else clang (triton/runtime/build.py)."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")


def build_learner(config: TrainConfig, dist: Dist) -> Learner:
    """Load the model (float32 masters), shard it (FSDP2), and make AdamW over the local shards."""
    config.check_dtypes()
    distributed.ensure_group(dist)
    vision = VisionSettings.from_model_dir(config.model)
    policy = sharded_policy(config, dist, vision)
    model = policy.model
    optimizer = torch.optim.AdamW(
        [p for p in policy.parameters() if p.requires_grad],
        lr=config.lr,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps,
        weight_decay=config.weight_decay,
        **optimizer_impl(config, dist.device),
    )
    # varlen or document-masked attention wastes nothing on one long row; a dense mask does
    varlen = getattr(model.config, "_attn_implementation", None) in ("flash_attention_2", *attention.PACKED)
    return Learner(policy=policy, module=policy, optimizer=optimizer, dist=dist,
                   attn_weight=attention_weight(getattr(model, "config", None)), pack_rows="one" if varlen else "auto",
                   vision=vision, pixels=PixelCache(vision) if vision is not None else None)


def optimizer_impl(config: TrainConfig, device: torch.device) -> dict[str, bool]:
    """AdamW's kernel. ``auto``: fused on CUDA (one kernel per parameter group, no temporaries the
    size of the model: the step stops being the memory peak); foreach elsewhere."""
    impl = config.optimizer_impl
    if impl == "auto":
        impl = "fused" if device.type == "cuda" else "foreach"
    if impl not in ("fused", "foreach", "for-loop"):
        raise ValueError(f"--optimizer-impl must be auto, fused, foreach or for-loop, got {impl!r}")
    return {"fused": impl == "fused", "foreach": impl == "foreach"}


RECOMPILE_LIMIT = 64  # graphs per compiled code object before dynamo silently runs it eagerly


def tune_layers(model: nn.Module, config: TrainConfig, device: torch.device) -> None:
    """Selective activation checkpointing (every ``k``-th decoder layer recomputes, the others keep
    their activations) and ``torch.compile`` of each decoder layer's parts (by default with CUDA).

    What is compiled is each direct child of a layer (its norms, its attention module, its MLP),
    with automatic dynamic shapes (static for the first length, the token dimensions dynamic
    after). That fuses the memory-bound work around the GEMMs: float32 RMSNorm, rotary, SiLU,
    casts. The layer's own forward is left alone, so FSDP's hooks and transformers' checkpoint
    call (both on it) stay outside every compiled region. The attention kernel stays eager
    (``attention.py`` marks it): one fused call per sample already, and traced, its per-sample
    spans made every new packing a new graph until dynamo hit its limit and ran the layers
    eagerly without a word. Micro-batch lengths change every step; after the first few,
    training never recompiles (tests/trainer/test_train_options.py)."""
    layers = decoder_layers(model)
    every = config.checkpoint_every_k_layers
    if every > 1:
        for i, layer in enumerate(layers):
            if hasattr(layer, "gradient_checkpointing") and layer.gradient_checkpointing:
                layer.gradient_checkpointing = i % every == 0
    if compiled_layers(config, device):
        # a few graphs per part: with and without grad (the log-prob passes), train and eval mode,
        # the static first length; above the limit dynamo would fall back to eager without a word
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
        for layer in layers:
            for part in layer.children():
                part.compile()


def sharded_policy(config: TrainConfig, dist: Dist, vision: VisionSettings | None = None) -> Policy:
    """The FSDP2-sharded policy. A text model is built on ``meta`` and each rank reads only its
    shards from the safetensors files (``loading.py``); a model whose checkpoint names differ from
    its modules (a vision model) is loaded whole on every rank, then sharded."""
    checkpointing = activation_checkpointing(config, dist.device)
    attn = packed_attention_for(config.model, pick_attn_implementation(config.attn_implementation, dist.device))
    param_dtype = compute_dtype(config, dist.device)
    make = dict(temperature=config.temperature, chunk_size=config.logprob_chunk_size, vision=vision)
    if vision is None and config.model_dtype == "float32" and config.sharded_load:
        meta = loading.build_meta_model(config.model, attn_implementation=attn)
        keys = loading.checkpoint_index(config.model)
        if loading.checkpoint_keys_match(meta, keys):
            policy = Policy(prepare_for_training(meta, checkpointing), **make)
            tune_layers(meta, config, dist.device)
            shard_policy(policy, dist, param_dtype=param_dtype)
            loading.materialize(policy, dist.device)
            loading.load_shards(policy.model, config.model, keys)
            return policy
    model = load_causal_lm(config.model, dtype=config.model_dtype, gradient_checkpointing=checkpointing,
                           attn_implementation=attn)
    policy = Policy(model, **make)
    tune_layers(model, config, dist.device)
    if dist.device.type != "cpu":
        policy.to(dist.device)
    return shard_policy(policy, dist, param_dtype=param_dtype)


def policy_inputs(mb: MicroBatch) -> dict[str, torch.Tensor | None]:
    """Policy inputs; log-probs are only computed for loss tokens (the rest are never used)."""
    inputs = {"input_ids": mb.input_ids, "attention_mask": mb.attention_mask, "position_ids": mb.position_ids,
              "loss_mask": mb.loss_mask}
    if mb.pixel_values is not None:
        inputs.update(pixel_values=mb.pixel_values, image_grid_thw=mb.image_grid_thw)
    if mb.rope_position_ids is not None:
        inputs["rope_position_ids"] = mb.rope_position_ids
    return inputs


def pack_share(learner: Learner, samples: Sequence[dict[str, Any]], advantages: Sequence[float]) -> MicroBatch:
    """One micro-batch of ``samples`` as this learner runs it: packed, with its images' pixels and
    M-RoPE positions (computed once here, on the CPU, for the proximal and the training pass)."""
    mb = pack(samples, range(len(samples)), advantages, rows=learner.pack_rows, attn_weight=learner.attn_weight)
    if learner.vision is not None and learner.pixels is not None:  # images in token order: the layout's sample order
        mb.pixel_values, mb.image_grid_thw = batch_pixels([samples[i] for i in mb.sample_indices], learner.pixels)
        mb.rope_position_ids = packed_rope_positions(learner.policy.body.get_rope_index, mb.input_ids, mb.position_ids,
                                                     mb.image_grid_thw, learner.vision.image_token_id)
    return mb


@dataclass
class MinibatchPlan:
    micro: list[MicroBatch]
    normalizer: float


def receive_share(
    learner: Learner, samples: Sequence[dict[str, Any]], advantages: Sequence[float], config: TrainConfig, step: int
) -> tuple[list[MinibatchPlan], dict[str, float]]:
    """Rank 0 plans the step and scatters; every rank packs its own share into micro-batches."""
    dist = learner.dist

    def plan() -> list[RankShare]:
        return plan_step(samples, advantages, world_size=dist.world_size, n_minibatches=config.ppo_n_minibatches,
                         micro_batch_tokens=config.micro_batch_tokens, seed=config.seed * 1_000_003 + step,
                         attn_weight=learner.attn_weight, loss_agg=config.loss_agg, rows=learner.pack_rows)

    share: RankShare = distributed.scatter(dist, plan() if dist.is_main else None)
    plans = []
    for groups, n_micro, normalizer in zip(share.minibatches, share.n_micro, share.normalizers):
        micro = [pack_share(learner, s, a) for s, a in groups]
        micro += [empty_micro_batch() for _ in range(n_micro - len(micro))]
        plans.append(MinibatchPlan([m.to(dist.device) for m in micro], normalizer))
    return plans, share.stats


def _gap_stats(m: MicroBatch, logprobs: torch.Tensor, version: int | None, gap: StatsAccumulator,
               gap_prox: StatsAccumulator) -> None:
    """Trainer vs engine under the weights held at the start of the step (see :func:`learner_step`).

    Besides the signed mean and the largest gap of each kind, both kinds together feed the
    agreement figures (:mod:`trainer_bridge.agreement`): mean ``|gap|`` and NeMo-RL's
    ``token_mult_prob_error`` (the mean of ``exp(|gap|)``).
    """
    if version is None:
        return
    loss = m.loss_mask.bool()
    fresh = loss & (m.versions == version)
    if fresh.any():
        diff = (logprobs - m.logprobs)[fresh].double()
        gap.add({"n_tokens": int(fresh.sum()), "engine_gap_mean": diff.mean().item(),
                 "engine_gap_abs_max": diff.abs().max().item(), "engine_gap_abs_mean": diff.abs().mean().item(),
                 "token_mult_prob_error_mean": diff.abs().exp().mean().item()})
    recomputed = loss & (m.versions == version - 1) & (m.proximal_versions == version)
    if recomputed.any():
        diff = (logprobs - m.proximal_logprobs_t)[recomputed].double()
        gap_prox.add({"n_tokens": int(recomputed.sum()), "engine_prox_gap_mean": diff.mean().item(),
                      "engine_prox_gap_abs_max": diff.abs().max().item(), "engine_gap_abs_mean": diff.abs().mean().item(),
                      "token_mult_prob_error_mean": diff.abs().exp().mean().item()})


@torch.no_grad()
def proximal_pass(policy: nn.Module, plans: list[MinibatchPlan], version: int | None,
                  gap: StatsAccumulator, gap_prox: StatsAccumulator) -> None:
    """Fill ``proximal_logprobs`` with the start-of-step weights, on the micro-batches training uses."""
    for plan in plans:
        for m in plan.micro:
            m.proximal_logprobs, _ = policy(**policy_inputs(m))
            _gap_stats(m, m.proximal_logprobs, version, gap, gap_prox)


def _token_flags(m: MicroBatch, version: int | None, config: TrainConfig) -> dict[str, Any]:
    """Per-token loss inputs that depend on the version the step starts from."""
    if version is None:
        return {}
    flags: dict[str, Any] = {"fresh": m.versions == version,
                             "recomputed": (m.versions == version - 1) & (m.proximal_versions == version),
                             "staleness": (version - m.versions).clamp(min=0),
                             "staleness_buckets": 8 if config.max_staleness is None else config.max_staleness + 1}
    if config.missing_proximal_mode == "fallback":
        flags["proximal_missing"] = (m.proximal_versions == m.versions) & (m.versions < version)
    return flags


def train_minibatch(learner: Learner, plan: MinibatchPlan, config: TrainConfig, version: int | None = None,
                    gaps: tuple[StatsAccumulator, StatsAccumulator] | None = None) -> tuple[StatsAccumulator, float]:
    """Accumulate gradients over the micro-batches (each backward reduce-scatters), clip, step.

    Returns this rank's stats (``loss_sum`` is its share of the minibatch loss) and the grad norm.
    ``gaps``: measure the engine gap here (the proximal pass was skipped).
    """
    dist = learner.dist
    learner.optimizer.zero_grad(set_to_none=True)
    acc = StatsAccumulator()
    for m in plan.micro:
        logprobs, entropy = learner.module(**policy_inputs(m))
        if gaps is not None:
            _gap_stats(m, logprobs.detach(), version, *gaps)
        loss, stats = decoupled_ppo_loss(
            logprobs=logprobs,
            proximal_logprobs=m.proximal_logprobs,
            old_logprobs=m.logprobs,
            proximal_logprobs_t=m.proximal_logprobs_t,
            advantages=m.advantages,
            loss_mask=m.loss_mask,
            eps_clip=config.eps_clip,
            eps_clip_higher=config.eps_clip_higher,
            c_clip=config.c_clip,
            behav_weight=config.behav_weight,
            behav_imp_weight_cap=config.behav_imp_weight_cap,
            behav_imp_weight_floor=config.behav_imp_weight_floor,
            loss_normalizer=plan.normalizer,
            loss_agg=config.loss_agg,
            seq_ids=m.seq_ids,
            loss_norm_tokens=config.loss_norm_tokens,
            tis_cap=config.engine_gap_cap if config.engine_gap_cap is not None else config.tis_cap,
            mis_band=config.mis_band(),
            **_token_flags(m, version, config),
        )
        # the loss is already the whole minibatch's mean; FSDP averages gradients over ranks, undo that
        (loss * dist.world_size).backward()
        mask = m.loss_mask.bool()
        stats["entropy_mean"] = (entropy.double() * mask).sum() / mask.sum().clamp(min=1)
        values = stats_to_floats(stats)  # the micro-batch's one host sync
        values["loss_sum"] = values.pop("loss")
        acc.add(_rename_staleness(values))
    params = [p for p in learner.policy.parameters() if p.requires_grad]
    max_norm = config.max_grad_norm if config.max_grad_norm is not None else float("inf")
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    set_warmup_lr(learner.optimizer, config.lr, config.lr_warmup_steps)
    learner.optimizer.step()
    return acc, grad_norm


def warmup_factor(done: int, warmup_steps: int) -> float:
    """Learning-rate factor of the optimizer step after ``done`` steps: k/(n+1) for the k-th of
    the first n, then 1."""
    return 1.0 if done >= warmup_steps else (done + 1) / (warmup_steps + 1)


def set_warmup_lr(optimizer: torch.optim.Optimizer, lr: float, warmup_steps: int) -> None:
    """Set the next step's learning rate. The step count is AdamW's own (``state["step"]``), so a
    run resumed from a checkpoint with its optimizer state carries on where it was."""
    if warmup_steps <= 0:
        return
    done = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step")
            if step is not None:
                done = int(step)
                break
        else:
            continue
        break
    for group in optimizer.param_groups:
        group["lr"] = lr * warmup_factor(done, warmup_steps)


def _rename_staleness(values: dict[str, float]) -> dict[str, float]:
    """Per-staleness sums as ``stale{k}_*_sum`` keys (summed when merged)."""
    out = {}
    for k, v in values.items():
        for prefix, name in (("behav_imp_weight_sum_by_staleness_", "w"), ("tokens_by_staleness_", "tokens")):
            if k.startswith(prefix):
                out[f"stale{k[len(prefix):]}_{name}_sum"] = v
                break
        else:
            out[k] = v
    return out


def merge_ranks(dist: Dist, acc: StatsAccumulator) -> StatsAccumulator:
    """Every rank's stats merged, on every rank."""
    merged = StatsAccumulator()
    for parts in distributed.gather(dist, acc.parts()):
        for part in parts:
            merged.add(part)
    return merged


def learner_step(
    learner: Learner,
    samples: Sequence[dict[str, Any]],
    advantages: Sequence[float],
    config: TrainConfig,
    step: int,
    version: int | None = None,
) -> dict[str, float]:
    """Proximal pass + ``ppo_n_minibatches`` optimizer steps; stats merged over all ranks.

    ``samples``/``advantages`` are read on rank 0 only (other ranks may pass empty lists): rank 0
    plans and sends each rank its share. With ``version`` (the version of the weights held at
    the start of the step), also reports ``engine_gap_mean``/``engine_gap_abs_max``: trainer minus
    engine log-prob on loss tokens that version sampled, and ``engine_prox_gap_*``: trainer minus
    the engine's recomputed log-prob under that version on tokens ``version - 1`` sampled. Same
    weights, so both should be ~0; anything else means the trainer and the engines disagree
    (temperature, numerics, or tokens out of place). Also the plan's ``imbalance`` (busiest
    rank's cost over the mean), ``padding_frac`` and the per-staleness mean behaviour weight
    ``behav_imp_weight_mean_stale{k}`` with its token count ``tokens_stale{k}``.
    """
    dist = learner.dist
    plans, plan_stats = receive_share(learner, samples, advantages, config, step)
    gap_behav, gap_prox = StatsAccumulator(), StatsAccumulator()
    skip_proximal = len(plans) == 1  # one optimizer step: the PPO ratio is identically 1
    if not skip_proximal:
        proximal_pass(learner.policy, plans, version, gap_behav, gap_prox)

    step_stats = StatsAccumulator()
    losses, grad_norms = [], []
    first_ratio_dev = 0.0
    for k, plan in enumerate(plans):
        acc, grad_norm = train_minibatch(learner, plan, config, version,
                                         gaps=(gap_behav, gap_prox) if skip_proximal else None)
        mb_stats = merge_ranks(dist, acc)
        grad_norms.append(grad_norm)
        if mb_stats.n:
            r = mb_stats.result()
            losses.append(r["loss_sum"])
            if k == 0:
                first_ratio_dev = max(abs(r["ratio_max"] - 1.0), abs(r["ratio_min"] - 1.0))
        step_stats.merge(mb_stats)
    gap, prox = merge_ranks(dist, gap_behav), merge_ranks(dist, gap_prox)

    out = step_stats.result()
    out.pop("loss_sum", None)
    out.pop("n_tokens", None)
    for key in [k for k in out if k.startswith("stale") and k.endswith("_w_sum")]:
        bucket = key[len("stale") : -len("_w_sum")]
        tokens = out.pop(f"stale{bucket}_tokens_sum", 0.0)
        w_sum = out.pop(key)
        if tokens:
            out[f"behav_imp_weight_mean_stale{bucket}"] = w_sum / tokens
            out[f"tokens_stale{bucket}"] = int(tokens)
    gap_stats, prox_stats = gap.result(), prox.result()
    both = StatsAccumulator()
    both.merge(gap)
    both.merge(prox)
    agreement = both.result()
    out.update(
        loss=sum(losses) / len(losses) if losses else 0.0,
        loss_tokens=step_stats.n,
        grad_norm=sum(grad_norms) / len(grad_norms) if grad_norms else 0.0,
        n_minibatches=len(plans),
        first_minibatch_ratio_dev=first_ratio_dev,
        proximal_pass_skipped=skip_proximal,
        engine_gap_tokens=gap_stats["n_tokens"],
        engine_gap_mean=gap_stats.get("engine_gap_mean", 0.0),
        engine_gap_abs_max=gap_stats.get("engine_gap_abs_max", 0.0),
        engine_prox_gap_tokens=prox_stats["n_tokens"],
        engine_prox_gap_mean=prox_stats.get("engine_prox_gap_mean", 0.0),
        engine_prox_gap_abs_max=prox_stats.get("engine_prox_gap_abs_max", 0.0),
        agreement_tokens=agreement["n_tokens"],
        agreement_token_share=agreement["n_tokens"] / step_stats.n if step_stats.n else 0.0,
        agreement_abs_gap_mean=agreement.get("engine_gap_abs_mean", 0.0),
        agreement_abs_gap_max=max(gap_stats.get("engine_gap_abs_max", 0.0), prox_stats.get("engine_prox_gap_abs_max", 0.0)),
        token_mult_prob_error=agreement.get("token_mult_prob_error_mean", 1.0) if agreement["n_tokens"] else None,
        lr=float(learner.optimizer.param_groups[0]["lr"]) if getattr(learner.optimizer, "param_groups", None) else 0.0,
        **plan_stats,
    )
    return out
