"""The GRPO trainer loop: pull samples from Splice proxies, take a decoupled-PPO step, publish.

One training step:

1. rank 0 leases samples (``/v1/trajectories/pull``), drops the too-stale ones, computes GRPO
   advantages and broadcasts the batch to every rank;
2. *proximal pass*: every sample's log-probs under the start-of-step weights, no grad. This is
   ``logp_prox`` of the loss, so the PPO ratio on the first minibatch is exactly 1;
3. ``ppo_n_minibatches`` optimizer steps; each accumulates gradients over token-budget
   micro-batches, normalized by the minibatch's total loss-token count (a global token mean,
   however the tokens are split over micro-batches and ranks);
4. rank 0 saves ``<out>/step_{k}`` (safetensors + tokenizer files), publishes it as version
   ``v + 1`` (the fleet publish protocol, ``trainer_bridge.publish``: every proxy pauses, each
   engine loads once, every proxy learns the version, every proxy resumes), then acks the leases.

Run it as ``splice train ...``, or under ``torchrun --nproc_per_node N -m trainer_bridge.train``
for data-parallel training. ``train(config, client=...)`` accepts any object with the
:class:`~trainer_bridge.client.ProxyClient` methods, which is how tests drive it.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import re
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import distributed
from .advantages import group_advantages
from .batching import MicroBatch, empty_micro_batch, make_micro_batches, validate_sample
from .client import ProxyClient, ProxyError
from .config import TrainConfig, config_from_argv
from .distributed import Dist
from .loss import decoupled_ppo_loss
from .policy import Policy, load_causal_lm, save_hf_dir
from .stats import StatsAccumulator
from .weight_transfer import TrainerPublisher, resolve_transfer

# -- which samples are trainable ----------------------------------------------------------------


def loss_token_versions(sample: dict[str, Any]) -> list[int]:
    return [int(v) for v, m in zip(sample["versions"], sample["loss_mask"]) if m]


def drop_reason(sample: dict[str, Any], version: int, max_staleness: int | None) -> str | None:
    """Why ``sample`` cannot be trained on at ``version`` (None when it can)."""
    try:
        validate_sample(sample)
    except (KeyError, TypeError, ValueError):
        return "invalid"
    if sample.get("trainable") is False:  # sampled with the agent's own settings, not the trainer's
        return "untrainable"
    versions = loss_token_versions(sample)
    if not versions:
        return "empty"
    if max_staleness is not None and min(versions) < version - max_staleness:
        return "stale"
    return None


def mask_missing_proximal(sample: dict[str, Any], version: int) -> dict[str, Any]:
    """Copy of ``sample`` with tokens whose ``pi_{v+1}`` value was never computed masked out.

    Such a token has ``proximal_versions == versions`` although version ``v+1`` has been live
    (``v < version``); its segment-wise weight would silently be 1.
    """
    out = dict(sample)
    out["loss_mask"] = [
        0 if (m and pv == v and v < version) else m
        for m, v, pv in zip(sample["loss_mask"], sample["versions"], sample["proximal_versions"])
    ]
    return out


def prepare_batch(
    samples: Sequence[dict[str, Any]], version: int, config: TrainConfig
) -> tuple[list[dict[str, Any]], list[float], dict[str, float]]:
    """Advantages over everything pulled (whole groups), then keep the trainable samples.

    Returns ``(samples, advantages, info)``; ``info`` holds the pull-level step stats. Reward
    stats are over the distinct sessions pulled (population std), like the advantages.
    """
    valid = [s for s in samples if drop_reason(s, version, None) != "invalid"]
    advantages = group_advantages(valid, normalize_std=config.adv_normalize_std) if valid else []
    dropped = {"invalid": len(samples) - len(valid), "empty": 0, "stale": 0}
    kept, kept_adv = [], []
    for s, a in zip(valid, advantages):
        reason = drop_reason(s, version, config.max_staleness)
        if reason is None:
            kept.append(s)
            kept_adv.append(a)
        else:
            dropped[reason] += 1

    staleness = [version - v for s in kept for v in loss_token_versions(s)]
    missing = sum(
        1
        for s in kept
        for m, v, pv in zip(s["loss_mask"], s["versions"], s["proximal_versions"])
        if m and pv == v and v < version
    )
    if config.mask_missing_proximal:
        kept = [mask_missing_proximal(s, version) for s in kept]
    rewards = {s["session_id"]: float(s["reward"]) for s in valid}
    reward_mean = sum(rewards.values()) / len(rewards) if rewards else 0.0
    info = {
        "n_samples_pulled": len(samples),
        "n_samples": len(kept),
        "n_dropped_stale": dropped["stale"],
        "n_dropped_empty": dropped["empty"],
        "n_dropped_invalid": dropped["invalid"],
        "n_sessions": len(rewards),
        "reward_mean": reward_mean,
        "reward_std": math.sqrt(sum((r - reward_mean) ** 2 for r in rewards.values()) / len(rewards)) if rewards else 0.0,
        "reward_min": min(rewards.values()) if rewards else 0.0,
        "reward_max": max(rewards.values()) if rewards else 0.0,
        "staleness_mean": sum(staleness) / len(staleness) if staleness else 0.0,
        "staleness_max": max(staleness) if staleness else 0,
        "missing_proximal_frac": missing / len(staleness) if staleness else 0.0,
        "tokens": sum(len(s["input_ids"]) for s in kept),
    }
    return kept, kept_adv, info


# -- pulling (rank 0) ---------------------------------------------------------------------------


@dataclass
class Batch:
    """What rank 0 pulled for one step, as broadcast to every rank."""

    samples: list[dict[str, Any]] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    leases: list[str] = field(default_factory=list)
    info: dict[str, float] = field(default_factory=dict)
    stop: bool = False  # no trainable samples before pull_timeout_s: end training


def collect_batch(client: Any, config: TrainConfig, version: int) -> Batch:
    """Pull until at least ``min_samples`` trainable samples (or ``pull_timeout_s`` runs out)."""
    start = time.monotonic()
    deadline = None if config.pull_timeout_s is None else start + config.pull_timeout_s
    pulled: list[dict[str, Any]] = []
    leases: list[str] = []
    while True:
        wait = config.pull_wait_s if deadline is None else max(0.0, min(config.pull_wait_s, deadline - time.monotonic()))
        lease, samples = client.pull(config.batch_samples, wait)
        if lease is not None:
            leases.append(lease)
        pulled.extend(samples)
        n_ok = sum(drop_reason(s, version, config.max_staleness) is None for s in pulled)
        if n_ok >= config.min_samples:
            break
        if deadline is not None and time.monotonic() >= deadline:
            if n_ok == 0:
                for lease_id in leases:  # nothing here will ever become trainable
                    client.ack(lease_id)
                return Batch(stop=True)
            break
        if not samples:
            time.sleep(0.2)
    kept, advantages, info = prepare_batch(pulled, version, config)
    info["pull_time_s"] = time.monotonic() - start
    return Batch(samples=kept, advantages=advantages, leases=leases, info=info)


# -- learning -----------------------------------------------------------------------------------


@dataclass
class Learner:
    """The model and its optimizer. ``module`` is ``policy`` itself or its DDP wrapper."""

    policy: Policy
    module: nn.Module
    optimizer: Any
    dist: Dist


def build_learner(config: TrainConfig, dist: Dist) -> Learner:
    model = load_causal_lm(config.model, dtype=config.model_dtype, gradient_checkpointing=config.gradient_checkpointing)
    policy = Policy(model, temperature=config.temperature, chunk_size=config.logprob_chunk_size).to(dist.device)
    module: nn.Module = policy
    if dist.enabled:
        # no buffer sync in forward: ranks may run different numbers of forwards per optimizer step
        ddp = nn.parallel.DistributedDataParallel
        no_sync_kw = (
            {"forward_sync_buffers": False}
            if "forward_sync_buffers" in inspect.signature(ddp.__init__).parameters
            else {"broadcast_buffers": False}
        )
        module = ddp(policy, device_ids=[dist.device.index] if dist.device.type == "cuda" else None, **no_sync_kw)
    optimizer = torch.optim.AdamW(
        [p for p in policy.parameters() if p.requires_grad],
        lr=config.lr,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps,
        weight_decay=config.weight_decay,
    )
    return Learner(policy=policy, module=module, optimizer=optimizer, dist=dist)


def minibatch_indices(n: int, n_minibatches: int, seed: int) -> list[list[int]]:
    """Shuffle ``range(n)`` (same seed on every rank) and cut it into near-equal minibatches."""
    if n == 0:
        return []
    k = max(1, min(n_minibatches, n))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return [perm[(i * n) // k : ((i + 1) * n) // k] for i in range(k)]


def _inputs(mb: MicroBatch) -> tuple[torch.Tensor, ...]:
    """Policy inputs; log-probs are only computed for loss tokens (the rest are never used)."""
    return mb.input_ids, mb.attention_mask, mb.position_ids, mb.loss_mask


def plan_minibatches(
    samples: Sequence[dict[str, Any]], advantages: Sequence[float], config: TrainConfig, step: int, dist: Dist
) -> list[tuple[list[MicroBatch], int]]:
    """Per minibatch: this rank's micro-batches and the minibatch's loss-token count (all ranks).

    Minibatch ``k`` is the same sample set on every rank; each rank takes ``minibatch[rank::world]``.
    A rank with nothing in a minibatch gets an empty micro-batch, so that every rank runs the
    same number of gradient-synchronizing backward passes.
    """
    plans = []
    for mb in minibatch_indices(len(samples), config.ppo_n_minibatches, config.seed * 1_000_003 + step):
        shard = mb[dist.rank :: dist.world_size]
        micro = make_micro_batches([samples[i] for i in shard], [advantages[i] for i in shard], config.micro_batch_tokens)
        micro = [m.to(dist.device) for m in (micro or [empty_micro_batch()])]
        n_loss_tokens = sum(sum(1 for m in samples[i]["loss_mask"] if m) for i in mb)
        plans.append((micro, n_loss_tokens))
    return plans


@torch.no_grad()
def proximal_pass(
    policy: Policy, plans: list[tuple[list[MicroBatch], int]], version: int | None
) -> tuple[StatsAccumulator, StatsAccumulator]:
    """Fill ``proximal_logprobs`` with the start-of-step weights, on the micro-batches training uses.

    Also measures the trainer/engine gap under the weights held now (``version``), twice:
    against the behaviour log-probs of tokens that version sampled, and against the engine's
    recomputed ``pi_{v+1}`` values (``proximal_logprobs_t``) of tokens sampled by ``version - 1``.
    Returns ``(behaviour gap, recomputed gap)``.
    """
    gap, gap_prox = StatsAccumulator(), StatsAccumulator()
    for micro, _ in plans:
        for m in micro:
            m.proximal_logprobs, _ = policy(*_inputs(m))
            if version is None:
                continue
            loss = m.loss_mask.bool()
            fresh = loss & (m.versions == version)
            if fresh.any():
                diff = (m.proximal_logprobs - m.logprobs)[fresh].double()
                gap.add({"n_tokens": int(fresh.sum()), "engine_gap_mean": diff.mean().item(),
                         "engine_gap_abs_max": diff.abs().max().item()})
            recomputed = loss & (m.versions == version - 1) & (m.proximal_versions == version)
            if recomputed.any():
                diff = (m.proximal_logprobs - m.proximal_logprobs_t)[recomputed].double()
                gap_prox.add({"n_tokens": int(recomputed.sum()), "engine_prox_gap_mean": diff.mean().item(),
                              "engine_prox_gap_abs_max": diff.abs().max().item()})
    return gap, gap_prox


def train_minibatch(learner: Learner, micro: list[MicroBatch], n_loss_tokens: int, config: TrainConfig) -> tuple[StatsAccumulator, float]:
    """Accumulate gradients over ``micro`` (synchronizing only on the last), clip, step.

    Returns this rank's stats (``loss_sum`` is its share of the minibatch loss) and the grad norm.
    """
    dist = learner.dist
    learner.optimizer.zero_grad(set_to_none=True)
    acc = StatsAccumulator()
    for j, m in enumerate(micro):
        last = j == len(micro) - 1
        with learner.module.no_sync() if dist.enabled and not last else contextlib.nullcontext():
            logprobs, entropy = learner.module(*_inputs(m))
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
                loss_normalizer=n_loss_tokens,
            )
            # the loss is already a mean over the whole minibatch; DDP averages over ranks, undo that
            (loss * dist.world_size).backward()
        stats["loss_sum"] = stats.pop("loss")
        if stats["n_tokens"]:
            stats["entropy_mean"] = entropy[m.loss_mask.bool()].mean().item()
        acc.add(stats)
    params = [p for p in learner.policy.parameters() if p.requires_grad]
    max_norm = config.max_grad_norm if config.max_grad_norm is not None else math.inf
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    learner.optimizer.step()
    return acc, grad_norm


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

    Every rank gets the full ``samples`` list and trains on its shard (see :func:`plan_minibatches`).
    With ``version`` (the version of the weights held at the start of the step), also reports
    ``engine_gap_mean``/``engine_gap_abs_max``: trainer minus engine log-prob on loss tokens that
    version sampled, and ``engine_prox_gap_*``: trainer minus the engine's recomputed log-prob
    under that version on tokens ``version - 1`` sampled. Same weights, so both should be ~0;
    anything else means the trainer and the engines disagree (temperature, numerics, or tokens
    out of place).
    """
    dist = learner.dist
    plans = plan_minibatches(samples, advantages, config, step, dist)
    gap_behav, gap_prox = proximal_pass(learner.policy, plans, version)
    gap, prox = merge_ranks(dist, gap_behav), merge_ranks(dist, gap_prox)

    step_stats = StatsAccumulator()
    losses, grad_norms = [], []
    first_ratio_dev = 0.0
    for k, (micro, n_loss_tokens) in enumerate(plans):
        acc, grad_norm = train_minibatch(learner, micro, n_loss_tokens, config)
        mb_stats = merge_ranks(dist, acc)
        grad_norms.append(grad_norm)
        if mb_stats.n:
            r = mb_stats.result()
            losses.append(r["loss_sum"])
            if k == 0:
                first_ratio_dev = max(abs(r["ratio_max"] - 1.0), abs(r["ratio_min"] - 1.0))
        step_stats.merge(mb_stats)

    out = step_stats.result()
    out.pop("loss_sum", None)
    out.pop("n_tokens", None)
    gap_stats, prox_stats = gap.result(), prox.result()
    out.update(
        loss=sum(losses) / len(losses) if losses else 0.0,
        loss_tokens=step_stats.n,
        grad_norm=sum(grad_norms) / len(grad_norms) if grad_norms else 0.0,
        n_minibatches=len(plans),
        first_minibatch_ratio_dev=first_ratio_dev,
        engine_gap_tokens=gap_stats["n_tokens"],
        engine_gap_mean=gap_stats.get("engine_gap_mean", 0.0),
        engine_gap_abs_max=gap_stats.get("engine_gap_abs_max", 0.0),
        engine_prox_gap_tokens=prox_stats["n_tokens"],
        engine_prox_gap_mean=prox_stats.get("engine_prox_gap_mean", 0.0),
        engine_prox_gap_abs_max=prox_stats.get("engine_prox_gap_abs_max", 0.0),
        lr=float(learner.optimizer.param_groups[0]["lr"]) if getattr(learner.optimizer, "param_groups", None) else 0.0,
    )
    return out


# -- publishing (rank 0) ------------------------------------------------------------------------

_STEP_DIR = re.compile(r"^step_(\d+)$")


def prune_step_dirs(out: Path, keep_last: int | None) -> None:
    if keep_last is None:
        return
    steps = sorted(
        (int(m.group(1)), p) for p in out.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))
    )
    for _, path in steps[: max(0, len(steps) - keep_last)]:
        shutil.rmtree(path, ignore_errors=True)


def ack_lease(client: Any, lease: str) -> None:
    """Ack, tolerating a lease the proxy already took back (it timed out during a long step)."""
    try:
        client.ack(lease)
    except ProxyError as e:
        if e.status not in (404, 409):
            raise
        print(f"warning: lease {lease} could not be acked ({e.message}); its samples may be served again", file=sys.stderr)


# -- reporting ----------------------------------------------------------------------------------


def format_stats(s: dict[str, Any]) -> str:
    return (
        f"step {s['step']} v{s['version']} | loss {s.get('loss', 0):+.4f} | clip {s.get('clip_frac', 0):.3f}"
        f" | w {s.get('behav_imp_weight_mean', 0):.3f}±{s.get('behav_imp_weight_std', 0):.3f}"
        f" max {s.get('behav_imp_weight_max', 0):.2f} | kl {s.get('behav_kl_mean', 0):+.4f}"
        f" | masked {s.get('masked_frac', 0):.3f} | ent {s.get('entropy_mean', 0):.3f}"
        f" | stale {s.get('staleness_mean', 0):.2f}/{s.get('staleness_max', 0)}"
        f" | reward {s.get('reward_mean', 0):.3f}±{s.get('reward_std', 0):.3f} | samples {s.get('n_samples', 0)}"
        f" (-{s.get('n_dropped_stale', 0)} stale) | tokens {s.get('loss_tokens', 0)}"
        f" | {s.get('train_time_s', 0):.1f}s train + {s.get('publish_time_s', 0):.1f}s publish"
    )


def _progress(config: TrainConfig, dist: Dist):
    if not (config.progress and dist.is_main):
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=config.steps, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)


def _log(bar: Any, line: str) -> None:
    if bar is not None:
        bar.write(line)
    else:
        print(line, flush=True)


def _quiet_transformers() -> None:
    """Our progress bar is the one to watch; silence transformers' per-save shard bars."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except Exception:
        pass


# -- the loop -----------------------------------------------------------------------------------


def train(config: TrainConfig, client: Any = None) -> list[dict[str, Any]]:
    """Run ``config.steps`` training steps; return the per-step stats (on every rank).

    ``client`` (rank 0 only) defaults to a :class:`ProxyClient` for ``config.proxies``.
    """
    config.validate()
    _quiet_transformers()
    dist = distributed.setup(config.device)
    own_client = dist.is_main and client is None
    if own_client:
        client = ProxyClient(config.proxies, admin_token=config.admin_token)
    bar = None
    publisher = None
    try:
        torch.manual_seed(config.seed)
        learner = build_learner(config, dist)
        out = Path(config.out).absolute()
        stats_path = Path(config.stats_path) if config.stats_path else out / "stats.jsonl"
        if dist.is_main:
            out.mkdir(parents=True, exist_ok=True)
            stats_path.parent.mkdir(parents=True, exist_ok=True)
        version = distributed.on_main(dist, lambda: client.version())
        transfer = distributed.on_main(dist, lambda: resolve_transfer(client, config.weight_transfer)) if config.publish else "disk"
        bar = _progress(config, dist)
        history: list[dict[str, Any]] = []
        for step in range(1, config.steps + 1):
            batch = distributed.on_main(dist, lambda: collect_batch(client, config, version))
            if batch.stop:
                if dist.is_main:
                    _log(bar, f"no trainable samples within {config.pull_timeout_s}s; stopping after step {step - 1}")
                break
            t0 = time.perf_counter()
            stats = learner_step(learner, batch.samples, batch.advantages, config, step, version=version)
            new_version = version + 1 if config.publish else version
            path = out / f"step_{step}"

            def publish() -> None:
                nonlocal publisher
                save_hf_dir(learner.policy.model, config.model, path, dtype=config.save_dtype)
                if config.publish and transfer == "distributed":  # docs/weight_transfer.md
                    if publisher is None:
                        dtype = getattr(torch, config.save_dtype) if config.save_dtype else None
                        publisher = TrainerPublisher(client, bucket_mb=config.bucket_mb, master_address=config.master_address, dtype=dtype)
                    publisher.publish(learner.policy.model, new_version)
                elif config.publish:
                    client.publish(str(path), new_version)
                for lease in batch.leases:  # trained on (or dropped as too stale): done with them
                    ack_lease(client, lease)
                prune_step_dirs(out, config.keep_last)

            t1 = time.perf_counter()
            distributed.on_main(dist, publish)
            t2 = time.perf_counter()
            record = {"step": step, "version": new_version, "trained_on_version": version, **batch.info, **stats}
            if config.log_sessions:
                record["session_ids"] = sorted({str(s["session_id"]) for s in batch.samples})
            record.update(train_time_s=t1 - t0, publish_time_s=t2 - t1, step_time_s=t2 - t0, model_path=str(path), weight_transfer=transfer)
            if dist.is_main:
                _log(bar, format_stats(record))
                with stats_path.open("a") as f:
                    f.write(json.dumps(record) + "\n")
                if bar is not None:
                    bar.update(1)
            history.append(record)
            version = new_version
        return history
    finally:
        if bar is not None:
            bar.close()
        if publisher is not None:
            publisher.close()
        if own_client:
            client.close()
        distributed.teardown(dist)


def main(argv: list[str] | None = None) -> int:
    """``splice train`` entry point."""
    config = config_from_argv(argv)
    train(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
