"""``splice bench train --gpu``: the trainer on one GPU beside a hand-written transformers baseline.

For each model shape (random weights, Qwen3 architecture, the real vocabulary): write the model
folder (bfloat16, as a released checkpoint), then on the same batch of agent-like samples

* **trainer**: ``build_learner`` exactly as ``splice train`` does (meta-device sharded loading,
  packed attention without a dense mask, fused AdamW, activation checkpointing) and
  ``learner_step``; then the publish of its weights to disk (``export.save_engine_dir``);
* **baseline**: what a user writes by hand: ``from_pretrained`` in float32, bf16 autocast, the
  same packing (one row per micro-batch, positions restarting per sample: transformers' sdpa
  block-diagonal mask), full logits, fused AdamW, activation checkpointing.

Reported per run: tokens/s of the timed steps, MFU (``6 N`` per token, and ``6 N`` plus the
causal attention matmuls, against the device's dense bf16 peak), peak CUDA memory during
forward/backward and during the optimizer step, and the publish's seconds per GB. An attention
microbench (one packed row, forward + backward) compares the kernels alone. Also runs on the
CPU with tiny shapes (how it is tested); rank 0 writes JSON to ``--out``.

Usage: python -m trainer_bridge.bench_gpu --out FILE [--models 0.6b,4b] [--samples 16] ...
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

SHAPES: dict[str, dict[str, int]] = {  # Qwen3 configs (tied embeddings, as released)
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128),
    "1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128),
    "4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16),
}
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "B200": 2250e12}


def device_peak(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def make_model(path: Path, shape: str, vocab: int, device: torch.device) -> tuple[int, dict[str, int]]:
    """A random Qwen3 model written as bfloat16 safetensors; returns (parameters, config)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=vocab, max_position_embeddings=40960, tie_word_embeddings=True, **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(path)
    del model
    _free(device)
    return n, SHAPES[shape]


def flops_per_step(n_params: int, shape: dict[str, int], lengths: list[int]) -> tuple[float, float]:
    """(6 N per token, 6 N + causal attention) FLOPs of one training step over ``lengths``."""
    tokens = sum(lengths)
    dense = 6.0 * n_params * tokens
    heads, dim, layers = shape["num_attention_heads"], shape["head_dim"], shape["num_hidden_layers"]
    # QK^T and PV: 2 matmuls x 2 flops x heads x dim per (query, key) pair; causal pairs L(L+1)/2; x3 fwd+bwd
    attn = sum(3 * 2 * 2 * heads * dim * layers * n * (n + 1) / 2 for n in lengths)
    return dense, dense + attn


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class MemorySplit:
    """Peak CUDA memory before the optimizer step (forward/backward, clipping) and during it."""

    def __init__(self, optimizer, device: torch.device):
        self.device, self.fwd_bwd, self.optim = device, 0, 0
        step = optimizer.step

        def wrapped(*args, **kwargs):
            if device.type == "cuda":
                self.fwd_bwd = max(self.fwd_bwd, torch.cuda.max_memory_allocated(device))
                torch.cuda.reset_peak_memory_stats(device)
            out = step(*args, **kwargs)
            if device.type == "cuda":
                self.optim = max(self.optim, torch.cuda.max_memory_allocated(device))
                torch.cuda.reset_peak_memory_stats(device)
            return out

        optimizer.step = wrapped

    def result(self) -> dict[str, float]:
        return {"peak_fwd_bwd_gib": self.fwd_bwd / 2**30, "peak_optim_gib": self.optim / 2**30}


def run_trainer(model_dir: Path, samples, advantages, args, dist, publish_dir: Path | None) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    from . import export
    from .config import TrainConfig
    from .learner import build_learner, compiled_layers, learner_step

    config = TrainConfig(proxies=["unused"], model=str(model_dir), micro_batch_tokens=args.micro_batch_tokens,
                         ppo_n_minibatches=1, lr=1e-5, progress=False, attn_implementation=args.attn,
                         compile_layers=args.compile, checkpoint_every_k_layers=args.ac_every)
    compiled = compiled_layers(config, dist.device)
    t0 = time.perf_counter()
    learner = build_learner(config, dist)
    _sync(dist.device)
    out: dict[str, Any] = {"load_s": time.perf_counter() - t0,
                           "attn": learner.policy.model.config._attn_implementation}
    mem = MemorySplit(learner.optimizer, dist.device)
    counters.clear()
    times, graphs = [], []
    for step in range(1, args.warmup + args.steps + 1):
        _sync(dist.device)
        t = time.perf_counter()
        learner_step(learner, samples, advantages, config, step, version=5)
        _sync(dist.device)
        times.append(time.perf_counter() - t)
        graphs.append(counters["stats"]["unique_graphs"])
    out.update(step_s=times, **mem.result())
    if compiled:  # proof the layers ran compiled: graphs per step, and no frame fell back to eager
        out.update(compiled_graphs_by_step=graphs, compiled_frames=dict(counters["frames"]),
                   compile_fallbacks=list(counters["unimplemented"])[:5])
    if args.profile:  # one more step under the profiler: where the time goes
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dist.device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            learner_step(learner, samples, advantages, config, 99, version=5)
            _sync(dist.device)
        key = "self_cuda_time_total" if dist.device.type == "cuda" else "self_cpu_time_total"
        out["profile"] = prof.key_averages().table(sort_by=key, row_limit=args.profile)
    if publish_dir is not None:
        _sync(dist.device)
        t = time.perf_counter()
        rep = export.save_engine_dir(learner.policy.model, dist, str(model_dir), publish_dir, dtype="bfloat16")
        out.update(publish_s=time.perf_counter() - t, publish_gb=rep.bytes / 1e9, publish_gather_s=rep.gather_s,
                   publish_files=rep.files)
    del learner, mem
    _free(dist.device)
    return out


def run_baseline(model_dir: Path, samples, advantages, args, device: torch.device) -> dict[str, Any]:
    """The hand-written loop (module docstring)."""
    from transformers import AutoModelForCausalLM

    from .batching import pack_micro_batches

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="sdpa")
    model.to(device)
    model.config.use_cache = False
    if args.baseline_ac:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    mem = MemorySplit(opt, device)
    micro = pack_micro_batches(samples, advantages, max_tokens=args.baseline_micro_batch_tokens, rows="one")
    n_loss = sum(float(m.loss_mask.sum()) for m in micro)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    out: dict[str, Any] = {"load_s": time.perf_counter() - t0}
    times = []
    for _ in range(args.warmup + args.steps):
        _sync(device)
        t = time.perf_counter()
        for m in micro:
            ids, pos = m.input_ids.to(device), m.position_ids.to(device)
            with autocast:
                logits = model(input_ids=ids, position_ids=pos).logits
            lp = torch.log_softmax(logits.float()[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            weight = (m.loss_mask * m.advantages)[:, 1:].to(device)
            loss = -(lp * weight).sum() / n_loss
            loss.backward()
            del logits, lp, loss
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        times.append(time.perf_counter() - t)
    out.update(step_s=times, **mem.result())
    del model, opt, mem
    _free(device)
    return out


def attention_microbench(device: torch.device, length: int, n_samples: int, heads: int, kv_heads: int, dim: int,
                         iters: int) -> dict[str, float]:
    """ms per forward + backward of one packed row of ``n_samples`` equal samples."""
    import torch.nn.functional as F

    from . import attention

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    each = length // n_samples
    pos = torch.cat([torch.arange(each) for _ in range(n_samples)]).unsqueeze(0).to(device)
    q = torch.randn(1, heads, length, dim, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(1, kv_heads, length, dim, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(1, kv_heads, length, dim, device=device, dtype=dtype, requires_grad=True)
    doc = attention.packed_layout(pos).doc_ids
    dense = (doc[0, :, None] == doc[0, None, :]) & torch.ones(length, length, dtype=torch.bool, device=device).tril()
    kernels = {
        "dense_mask_sdpa": lambda L: F.scaled_dot_product_attention(q, k, v, attn_mask=dense[None, None], enable_gqa=True),
        "per_sample_sdpa": lambda L: attention.per_sample_sdpa(q, k, v, L, None),
    }
    if device.type == "cuda":
        kernels["flex_block_mask"] = lambda L: attention.flex_attention(q, k, v, L, None)
        if attention.has_varlen():
            kernels["torch_varlen"] = lambda L: attention.varlen_attention(q, k, v, L, None)
    out: dict[str, float] = {}
    for name, fn in kernels.items():
        try:
            impl = attention.FLEX if name == "flex_block_mask" else None
            layout = attention.packed_layout(pos, impl)
            for _ in range(2):
                fn(layout).sum().backward()
            _sync(device)
            t = time.perf_counter()
            for _ in range(iters):  # the layout is built once per forward, not per layer: prebuilt here
                fn(layout).sum().backward()
            _sync(device)
            out[name] = 1000 * (time.perf_counter() - t) / iters
            t = time.perf_counter()
            for _ in range(iters):
                attention.packed_layout(pos, impl)
            _sync(device)
            out[f"{name}_layout_build"] = 1000 * (time.perf_counter() - t) / iters
        except Exception as e:  # noqa: BLE001 - a kernel this torch lacks is reported, not fatal
            out[name] = float("nan")
            out[f"{name}_error"] = repr(e)[:300]
    return out


def main(argv: list[str] | None = None) -> int:
    from .config import TrainConfig

    ap = argparse.ArgumentParser(prog="python -m trainer_bridge.bench_gpu")
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="0.6b,4b", help=f"comma-separated shapes: {', '.join(SHAPES)}")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--min-len", type=int, default=2048)
    ap.add_argument("--max-len", type=int, default=16384)
    ap.add_argument("--micro-batch-tokens", type=int, default=TrainConfig.micro_batch_tokens,
                    help="the trainer's --micro-batch-tokens")
    ap.add_argument("--baseline-micro-batch-tokens", type=int, default=8192,
                    help="the baseline's (its dense masks grow with the square: 8,192 is its fastest)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--attn", default="auto", help="the trainer's --attn-implementation")
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                    help="the trainer's --compile-layers (default: the trainer's, on with CUDA)")
    ap.add_argument("--ac-every", type=int, default=1, help="the trainer's --checkpoint-every-k-layers")
    ap.add_argument("--profile", type=int, default=0, help="profile one more trainer step: top N ops")
    ap.add_argument("--no-baseline", dest="baseline", action="store_false")
    ap.add_argument("--baseline-ac", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--publish", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--attn-bench", default="8192,4,32,8,128", help="length,samples,heads,kv_heads,dim ('' skips)")
    ap.add_argument("--workdir", default=None, help="where model folders go (default: a temporary directory)")
    args = ap.parse_args(argv)
    started = time.perf_counter()

    from . import distributed
    from .bench import synthetic_samples

    dist = distributed.setup("auto")
    device = dist.device
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                              "torch": torch.__version__, "peak_flops": device_peak(device), "args": vars(args),
                              "runs": []}
    out_path = Path(args.out)

    def save() -> None:
        out_path.write_text(json.dumps(result, indent=1))

    if args.attn_bench:
        length, n, h, kvh, d = (int(x) for x in args.attn_bench.split(","))
        result["attention_ms"] = attention_microbench(device, length, n, h, kvh, d, iters=10 if device.type == "cuda" else 2)
        print("attention ms (fwd+bwd):", json.dumps(result["attention_ms"]), flush=True)
        save()
    with tempfile.TemporaryDirectory(prefix="splice-bench-gpu-", dir=args.workdir) as tmp:
        for shape in args.models.split(","):
            model_dir = Path(tmp) / shape
            n_params, cfg = make_model(model_dir, shape, args.vocab, device)
            samples = synthetic_samples(args.samples, args.min_len, args.max_len, args.vocab, version=5, seed=0)
            advantages = [1.0 if s["reward"] else -1.0 for s in samples]
            lengths = [len(s["input_ids"]) for s in samples]
            dense, with_attn = flops_per_step(n_params, cfg, lengths)
            run = {"model": shape, "n_params": n_params, "tokens_per_step": sum(lengths), "lengths": lengths,
                   "flops_6n": dense, "flops_6n_attn": with_attn}
            result["runs"].append(run)
            for name in ("trainer", "baseline"):
                if name == "baseline" and not args.baseline:
                    continue
                try:
                    if name == "trainer":
                        res = run_trainer(model_dir, samples, advantages, args, dist,
                                          Path(tmp) / f"{shape}-published" if args.publish else None)
                    else:
                        res = run_baseline(model_dir, samples, advantages, args, device)
                except Exception as e:  # noqa: BLE001 - recorded; the trainer retries with per-sample SDPA
                    res = {"error": repr(e)[:400]}
                    _free(device)
                    if name == "trainer" and args.attn != "splice_sdpa":
                        print(shape, "trainer failed:", res["error"], "- retrying with splice_sdpa", flush=True)
                        failed, args.attn = res, "splice_sdpa"
                        try:
                            res = run_trainer(model_dir, samples, advantages, args, dist, None)
                        except Exception as e2:  # noqa: BLE001
                            res = {"error": repr(e2)[:400]}
                        res["first_error"] = failed["error"]
                        _free(device)
                timed = res.get("step_s", [])[args.warmup:]
                if timed:
                    step_s = sum(timed) / len(timed)
                    res["tokens_per_s"] = sum(lengths) / step_s
                    if result["peak_flops"]:
                        res["mfu_6n"] = dense / step_s / result["peak_flops"]
                        res["mfu_6n_attn"] = with_attn / step_s / result["peak_flops"]
                res["elapsed_s"] = time.perf_counter() - started
                run[name] = res
                print(shape, name, json.dumps({k: v for k, v in res.items() if k != "profile"}), flush=True)
                if res.get("profile"):
                    print(res["profile"], flush=True)
                save()
            _free(device)
    distributed.teardown(dist)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
