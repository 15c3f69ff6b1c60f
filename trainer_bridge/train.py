"""The GRPO trainer loop: pull samples from Splice proxies, take a decoupled-PPO step, publish.

One training step:

1. rank 0 leases samples (``/v1/trajectories/pull``), masks loss tokens older than
   ``max_staleness`` (a sample with none left is dropped) and computes GRPO advantages;
2. the learner step (``learner.py``): rank 0 plans which rank trains which samples and sends
   each rank only its share; a proximal pass (skipped with one minibatch); ``ppo_n_minibatches``
   AdamW steps on the FSDP2-sharded model over packed micro-batches;
3. every rank hands its shards to rank 0, which saves ``<out>/step_{k}`` (safetensors + tokenizer
   files), publishes it as version ``v + 1`` (the fleet publish protocol,
   ``trainer_bridge.publish``) and acks the leases;
4. every ``checkpoint_every`` steps (and after the last), a sharded training checkpoint
   (``checkpoint.py``) that ``--resume`` continues from.

Run it as ``splice train ...``, or under ``torchrun --nproc-per-node N -m trainer_bridge.train``
(docs/training.md). ``train(config, client=...)`` accepts any object with the
:class:`~trainer_bridge.client.ProxyClient` methods, which is how tests drive it.
"""

from __future__ import annotations

import json
import math
import re
import resource
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from . import distributed, export
from .advantages import episode_loss_weights, group_advantages
from .agreement import EXIT_CODE as AGREEMENT_EXIT_CODE
from .agreement import AgreementError, AgreementGate
from .batching import validate_sample
from .checkpoint import load_checkpoint, prune_checkpoints, save_checkpoint
from .client import ProxyClient, ProxyError
from .config import TrainConfig, config_from_argv
from .distributed import Dist
from .image_fetch import ImageSource
from .learner import Learner, build_learner, learner_step  # noqa: F401 - re-exported for callers
from .policy import checkpoint_dtype, save_hf_dir
from .vision import ImageInputError, VisionSettings, image_refs, untrainable_reason
from .weight_transfer import TrainerPublisher, full_tensors, resolve_transfer

# -- which samples are trainable ----------------------------------------------------------------


def loss_token_versions(sample: dict[str, Any]) -> list[int]:
    return [int(v) for v, m in zip(sample["versions"], sample["loss_mask"]) if m]


def drop_reason(sample: dict[str, Any], version: int, max_staleness: int | None,
                vision: VisionSettings | None = None) -> str | None:
    """Why ``sample`` cannot be trained on at ``version`` (None when it can).

    With a vision model, ``banned_token``: a loss token is a vision control id (banned at
    sampling, so it should never be there) or placeholder tokens lie outside the image spans.
    """
    try:
        validate_sample(sample)
    except (KeyError, TypeError, ValueError):
        return "invalid"
    if sample.get("trainable") is False:  # sampled with the agent's own settings, not the trainer's
        return "untrainable"
    if vision is None and image_refs(sample):
        raise ImageInputError(f"sample {sample.get('sample_id')!r} has images but --model is not a vision "
                              "model (Qwen2.5-VL with preprocessor_config.json)")
    if (reason := untrainable_reason(sample, vision)) is not None:
        return reason
    versions = loss_token_versions(sample)
    if not versions:
        return "empty"
    if max_staleness is not None and max(versions) < version - max_staleness:
        return "stale"  # every loss token is too old (older ones alone are masked, not dropped)
    return None


def mask_stale(sample: dict[str, Any], version: int, max_staleness: int | None) -> tuple[dict[str, Any], int]:
    """``sample`` with loss tokens sampled before ``version - max_staleness`` masked, and how many.

    A long agent run keeps its recent turns instead of being thrown away for its first ones.
    """
    if max_staleness is None:
        return sample, 0
    oldest = version - max_staleness
    mask = [0 if (m and v < oldest) else m for m, v in zip(sample["loss_mask"], sample["versions"])]
    n = sum(1 for a, b in zip(mask, sample["loss_mask"]) if a != b)
    return (dict(sample, loss_mask=mask) if n else sample), n


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
    samples: Sequence[dict[str, Any]], version: int, config: TrainConfig, vision: VisionSettings | None = None
) -> tuple[list[dict[str, Any]], list[float], dict[str, float]]:
    """Advantages over everything pulled (whole groups), then keep the trainable samples.

    Returns ``(samples, advantages, info)``; ``info`` holds the pull-level step stats. Reward
    stats are over the distinct sessions pulled (population std), like the advantages.
    """
    valid = [s for s in samples if drop_reason(s, version, None, vision) != "invalid"]
    advantages = group_advantages(valid, normalize_std=config.adv_normalize_std) if valid else []
    dropped = {"invalid": len(samples) - len(valid), "empty": 0, "stale": 0, "untrainable": 0, "banned_token": 0}
    kept, kept_adv = [], []
    n_stale_masked = 0
    for s, a in zip(valid, advantages):
        reason = drop_reason(s, version, config.max_staleness, vision)
        if reason is None:
            s, n = mask_stale(s, version, config.max_staleness)
            n_stale_masked += n
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
    if config.missing_proximal_mode == "mask":
        kept = [mask_missing_proximal(s, version) for s in kept]
    if config.episode_weighting != "token" and kept:
        # a sample's loss terms scale with its advantage (clip and dual clip included), so
        # weighting the advantage weights the sample (trainer_bridge.advantages.episode_loss_weights)
        kept_adv = [a * w for a, w in zip(kept_adv, episode_loss_weights(kept, config.episode_weighting))]
    rewards = {s["session_id"]: float(s["reward"]) for s in valid}
    reward_mean = sum(rewards.values()) / len(rewards) if rewards else 0.0
    info = {
        "n_samples_pulled": len(samples),
        "n_samples": len(kept),
        "n_dropped_stale": dropped["stale"],
        "n_dropped_empty": dropped["empty"],
        "n_dropped_invalid": dropped["invalid"],
        "n_dropped_untrainable": dropped["untrainable"],
        "n_dropped_banned_token": dropped["banned_token"],
        "n_stale_tokens_masked": n_stale_masked,
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


def collect_batch(client: Any, config: TrainConfig, version: int, images: ImageSource | None = None) -> Batch:
    """Pull until at least ``min_samples`` trainable samples (or ``pull_timeout_s`` runs out).

    ``images`` (a vision model): fetch, check and attach the kept samples' images.
    """
    vision = images.settings if images is not None else None
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
        n_ok = sum(drop_reason(s, version, config.max_staleness, vision) is None for s in pulled)
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
    kept, advantages, info = prepare_batch(pulled, version, config, vision)
    if images is not None:
        fetched = images.n_fetched
        info["n_images"] = images.attach(kept)
        info["n_images_fetched"] = images.n_fetched - fetched
    info["pull_time_s"] = time.monotonic() - start
    return Batch(samples=kept, advantages=advantages, leases=leases, info=info)


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
        f" | agree {_agreement(s)}"
        f" | stale {s.get('staleness_mean', 0):.2f}/{s.get('staleness_max', 0)}"
        f" | reward {s.get('reward_mean', 0):.3f}±{s.get('reward_std', 0):.3f} | samples {s.get('n_samples', 0)}"
        f" (-{s.get('n_dropped_stale', 0)} stale) | tokens {s.get('loss_tokens', 0)}"
        f" | imbalance {s.get('imbalance', 1.0):.2f} pad {s.get('padding_frac', 0.0):.1%}"
        f" | {s.get('train_time_s', 0):.1f}s train + {s.get('publish_time_s', 0):.1f}s publish"
    )


def _agreement(s: dict[str, Any]) -> str:
    """``token_mult_prob_error`` and its token count, or ``-`` when the step measured none."""
    err = s.get("token_mult_prob_error")
    return "-" if err is None else f"{err:.4f}/{s.get('agreement_tokens', 0)}"


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


def full_state_dict(learner: Learner) -> dict[str, torch.Tensor]:
    """Collective: the whole model's weights gathered from the shards, on rank 0's CPU (empty elsewhere)."""
    sd = get_model_state_dict(learner.policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    prefix = "model."
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in sd.items()}


def publish_dir(learner: Learner, config: TrainConfig, path: Path, engine_dtype: str | None) -> None:
    """Collective: write the step's weights to ``path`` (rank 0). A text model goes through
    ``export.save_engine_dir`` (engine dtype on device, bucket by bucket, a tied head once); a
    vision model through transformers' ``save_pretrained`` (its checkpoint key conversion)."""
    if learner.vision is None:
        export.save_engine_dir(learner.policy.model, learner.dist, config.model, path, dtype=engine_dtype,
                               bucket_mb=config.export_bucket_mb)
        return
    weights = full_state_dict(learner)
    distributed.on_main(learner.dist, lambda: save_hf_dir(learner.policy.model, config.model, path, dtype=engine_dtype,
                                                          state_dict=weights))


def peak_memory(dist: Dist) -> dict[str, float]:
    """This process's peak RSS (and peak CUDA allocation), in MB."""
    out = {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if dist.device.type == "cuda":
        out["peak_cuda_mb"] = torch.cuda.max_memory_allocated(dist.device) / 2**20
    return out


def _resume(learner: Learner, config: TrainConfig, dist: Dist) -> int:
    """Load ``--resume`` (if given); return the first step to run."""
    if not config.resume:
        return 1
    state = load_checkpoint(learner.policy, learner.optimizer, config.resume, dist)
    return int(state["step"]) + 1


def train(config: TrainConfig, client: Any = None) -> list[dict[str, Any]]:
    """Run training steps up to ``config.steps``; return the per-step stats (on every rank).

    ``client`` (rank 0 only) defaults to a :class:`ProxyClient` for ``config.proxies``. With
    ``config.resume``, continues from that checkpoint's step + 1.
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
        first_step = _resume(learner, config, dist)
        out = Path(config.out).absolute()
        ckpt_root = out / "checkpoints"
        stats_path = Path(config.stats_path) if config.stats_path else out / "stats.jsonl"
        if dist.is_main:
            out.mkdir(parents=True, exist_ok=True)
            stats_path.parent.mkdir(parents=True, exist_ok=True)
        version = distributed.on_main(dist, lambda: client.version())
        transfer = distributed.on_main(dist, lambda: resolve_transfer(client, config.weight_transfer)) if config.publish else "disk"
        engine_dtype = config.save_dtype or checkpoint_dtype(config.model)  # what the engines run in (bf16 for a bf16 model)
        bar = _progress(config, dist)
        # rank 0 fetches each image once (GET /v1/images/{hash}) and sends the bytes with the share
        images = ImageSource(learner.vision, lambda h: client.image_bytes(h)) if learner.vision is not None and dist.is_main else None
        history: list[dict[str, Any]] = []
        gate = AgreementGate(config.agreement_max_error, config.agreement_patience)
        for step in range(first_step, config.steps + 1):
            pulled: list[Batch] = []

            def pull() -> Batch:
                """Rank 0 keeps the samples; the other ranks get the batch without them."""
                batch = collect_batch(client, config, version, images)
                pulled.append(batch)
                header = Batch(leases=batch.leases, info=dict(batch.info), stop=batch.stop)
                if config.log_sessions:
                    header.info["session_ids"] = sorted({str(s["session_id"]) for s in batch.samples})
                return header

            header = distributed.on_main(dist, pull)
            batch = pulled[0] if dist.is_main else header
            if header.stop:
                if dist.is_main:
                    _log(bar, f"no trainable samples within {config.pull_timeout_s}s; stopping after step {step - 1}")
                break
            t0 = time.perf_counter()
            stats = learner_step(learner, batch.samples, batch.advantages, config, step, version=version)
            stats.update(gate.check(stats))  # identical on every rank: the stats are merged over ranks
            if gate.tripped:  # publish nothing, ack nothing: the samples go back to the pool
                record = {"step": step, "version": version, "trained_on_version": version, **dict(header.info), **stats}
                if dist.is_main:
                    _log(bar, format_stats(record))
                    with stats_path.open("a") as f:
                        f.write(json.dumps(record) + "\n")
                history.append(record)
                raise AgreementError(gate.message(stats))
            new_version = version + 1 if config.publish else version
            path = out / f"step_{step}"

            t1 = time.perf_counter()
            streamed = config.publish and transfer == "distributed"
            # A broadcast publish needs no directory: each tensor is gathered from the shards as
            # its bucket is sent (memory bounded by a bucket). The last step is still saved.
            save_dir = not streamed or step == config.steps
            # -- weights out (export.py): gathered in the engine dtype, rank 0 writes bucket by bucket
            if save_dir:
                publish_dir(learner, config, path, engine_dtype)
            dtype = getattr(torch, engine_dtype) if engine_dtype else None
            # Collective on every rank: all of them gather each tensor, rank 0 alone sends it.
            named = full_tensors(learner.policy.model, dtype=dtype) if streamed else iter(())

            def publish() -> None:
                nonlocal publisher
                if streamed:  # docs/weight_transfer.md
                    if publisher is None:
                        publisher = TrainerPublisher(client, bucket_mb=config.bucket_mb, master_address=config.master_address, dtype=dtype)
                    try:
                        publisher.publish_named(named, new_version)
                    finally:
                        for _ in named:  # the other ranks gather every tensor: so does rank 0
                            pass
                elif config.publish:
                    client.publish(str(path), new_version)
                for lease in batch.leases:  # trained on (or dropped as too stale): done with them
                    ack_lease(client, lease)
                prune_step_dirs(out, config.keep_last)

            if not dist.is_main:
                for _ in named:  # rank 0 gathers the same tensors while it sends them
                    pass
            distributed.on_main(dist, publish)
            t2 = time.perf_counter()
            every = config.checkpoint_every
            if every and (step % every == 0 or step == config.steps):
                save_checkpoint(learner.policy, learner.optimizer, ckpt_root / f"step_{step}", dist, {"step": step})
                if dist.is_main:
                    prune_checkpoints(ckpt_root, config.keep_checkpoints)
            t3 = time.perf_counter()
            memory = distributed.gather(dist, peak_memory(dist))
            info = dict(header.info)
            session_ids = info.pop("session_ids", None)
            record = {"step": step, "version": new_version, "trained_on_version": version, **info, **stats}
            record["peak_rss_mb_max"] = max(m["peak_rss_mb"] for m in memory)
            record["peak_rss_mb_by_rank"] = [round(m["peak_rss_mb"], 1) for m in memory]
            if "peak_cuda_mb" in memory[0]:
                record["peak_cuda_mb_by_rank"] = [round(m["peak_cuda_mb"], 1) for m in memory]
            if config.log_sessions:
                record["session_ids"] = session_ids
            record.update(train_time_s=t1 - t0, publish_time_s=t2 - t1, checkpoint_time_s=t3 - t2,
                          step_time_s=t3 - t0, model_path=str(path), weight_transfer=transfer)
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
    try:
        train(config)
    except AgreementError as exc:
        print(f"splice train: stopped: {exc}", file=sys.stderr, flush=True)
        return AGREEMENT_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
