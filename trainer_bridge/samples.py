"""Sample preparation for a training step, behind one seam (:func:`pull_step`).

Rank 0 leases samples until enough are trainable (``collect_batch``), then ``prepare_batch``:
validation (a sample the trainer cannot read, an untrainable or image-less-model sample is
dropped), GRPO advantages over whole groups, loss tokens older than ``max_staleness`` masked (a
sample with none left is dropped), tokens whose proximal value was never computed masked
(``missing_proximal_mode="mask"``), episode weighting; a vision model's images are fetched once and
attached (``image_fetch``). ``trainer_bridge.train`` re-exports these names.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from . import distributed
from .advantages import episode_loss_weights, group_advantages
from .batching import validate_sample
from .config import TrainConfig
from .distributed import Dist
from .image_fetch import ImageSource
from .vision import ImageInputError, VisionSettings, image_refs, untrainable_reason


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


def pull_step(dist: Dist, client: Any, config: TrainConfig, version: int, images: ImageSource | None = None) -> tuple[Batch, Batch]:
    """Collective: rank 0 pulls and prepares the step's samples (:func:`collect_batch`); every rank
    gets the header (leases, pull stats, ``stop``). Returns ``(header, batch)``: on rank 0 the
    batch holds the samples, elsewhere it is the header (each rank's share comes with the plan)."""
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
    return header, (pulled[0] if dist.is_main else header)
