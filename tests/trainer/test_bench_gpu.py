"""``trainer_bridge.bench_gpu`` runs end to end on the CPU with a tiny shape (how the GPU script is
prepared), and ``splice bench train --gpu`` prints its table. No timings are asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_gpu_on_cpu_writes_every_field(tmp_path, capsys):
    out = tmp_path / "bench.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "trainer_bridge.bench_gpu", "--out", str(out), "--models", "tiny",
                           "--vocab", "300", "--samples", "3", "--min-len", "8", "--max-len", "40",
                           "--micro-batch-tokens", "64", "--baseline-micro-batch-tokens", "64", "--attn-bench", "96,3,4,2,16", "--workdir", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    att = result["attention_ms"]
    assert att["dense_mask_sdpa"] > 0 and att["per_sample_sdpa"] > 0
    (run,) = result["runs"]
    assert run["tokens_per_step"] == sum(run["lengths"])
    trainer, baseline = run["trainer"], run["baseline"]
    assert trainer["attn"] == "splice_sdpa" and len(trainer["step_s"]) == len(baseline["step_s"]) == 2
    assert trainer["tokens_per_s"] > 0 and baseline["tokens_per_s"] > 0
    # the published folder: every parameter once (tied head), 2 bytes each
    assert trainer["publish_gb"] * 1e9 == 2 * run["n_params"]
    # 6N per token, and causal attention pairs on top
    assert run["flops_6n"] == 6 * run["n_params"] * run["tokens_per_step"]
    assert run["flops_6n_attn"] > run["flops_6n"]

    from proxy.bench.train import print_gpu_table

    print_gpu_table(result)
    table = capsys.readouterr().out
    assert "trainer" in table and "baseline" in table and "per_sample_sdpa" in table
