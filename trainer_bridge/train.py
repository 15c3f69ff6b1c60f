"""The GRPO trainer loop: pull samples from Splice proxies, take a decoupled-PPO step, publish.

One training step, each behind its own seam:

1. samples (``samples.py``, ``pull_step``): rank 0 leases samples (``/v1/trajectories/pull``),
   validates them, masks loss tokens older than ``max_staleness`` (a sample with none left is
   dropped) and those whose proximal value is missing, computes GRPO advantages and attaches a
   vision model's images;
2. the learner step (``learner.py``, ``learner_step``): rank 0 plans which rank trains which
   samples and sends each rank only its share; a proximal pass (skipped with one minibatch);
   ``ppo_n_minibatches`` AdamW steps on the FSDP2-sharded model over packed micro-batches;
3. publish (``step_publish.py``, ``StepPublisher``): every rank hands its shards to rank 0, which
   saves ``<out>/step_{k}`` (safetensors + tokenizer files), publishes it as version ``v + 1``
   (the fleet publish protocol, ``trainer_bridge.publish``) and acks the leases;
4. every ``checkpoint_every`` steps (and after the last), a sharded training checkpoint
   (``checkpoint.py``) that ``--resume`` continues from.

Run it as ``splice train ...``, or under ``torchrun --nproc-per-node N -m trainer_bridge.train``
(docs/training.md). ``train(config, client=...)`` accepts any object with the
:class:`~trainer_bridge.client.ProxyClient` methods, which is how tests drive it.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from . import distributed
from .agreement import EXIT_CODE as AGREEMENT_EXIT_CODE
from .agreement import AgreementError, AgreementGate
from .checkpoint import load_checkpoint, prune_checkpoints, save_checkpoint
from .client import ProxyClient
from .config import TrainConfig, config_from_argv
from .distributed import Dist
from .image_fetch import ImageSource
from .learner import Learner, build_learner, learner_step  # noqa: F401 - re-exported for callers
from .policy import checkpoint_dtype
from .samples import (  # noqa: F401 - the sample-preparation seam; re-exported for callers
    Batch,
    collect_batch,
    drop_reason,
    loss_token_versions,
    mask_missing_proximal,
    mask_stale,
    prepare_batch,
    pull_step,
)
from .step_publish import StepPublisher, ack_lease, full_state_dict, prune_step_dirs, publish_dir  # noqa: F401 - re-exported
from .weight_transfer import resolve_transfer


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
        publisher = StepPublisher(client, config, learner, out, transfer, engine_dtype)
        # rank 0 fetches each image once (GET /v1/images/{hash}) and sends the bytes with the share
        images = ImageSource(learner.vision, lambda h: client.image_bytes(h)) if learner.vision is not None and dist.is_main else None
        history: list[dict[str, Any]] = []
        gate = AgreementGate(config.agreement_max_error, config.agreement_patience)
        for step in range(first_step, config.steps + 1):
            # 1. samples: rank 0 pulls and prepares them (samples.py); every rank gets the header
            header, batch = pull_step(dist, client, config, version, images)
            if header.stop:
                if dist.is_main:
                    _log(bar, f"no trainable samples within {config.pull_timeout_s}s; stopping after step {step - 1}")
                break
            # 2. the learner step (learner.py)
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
            # 3. publish (step_publish.py): the weights out, the leases acked
            t1 = time.perf_counter()
            path = publisher.publish(step, new_version, batch.leases)
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
