"""The published folder has the same tensors at 1 and 2 ranks, tied head or not, and equals what
transformers' own ``save_pretrained`` writes for the loaded model (cast to bfloat16).

The learner is built from the meta device with sharded loading, so this also checks that every
rank's shards were read from the right rows of the safetensors files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

WORKER = Path(__file__).with_name("export_worker.py")
REPO = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1",
                PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _model(path: Path, tied: bool) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(1)
    cfg = Qwen3Config(vocab_size=203, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=tied)
    Qwen3ForCausalLM(cfg).save_pretrained(path)  # odd row counts: uneven shards over 2 ranks
    (path / "tokenizer_config.json").write_text("{}")
    return path


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        part = load_file(f)
        assert not out.keys() & part.keys()  # every tensor written once
        out.update(part)
    return out


@pytest.mark.parametrize("tied", [True, False])
def test_published_tensors_equal_at_one_and_two_ranks(tmp_path, tied):
    from transformers import AutoModelForCausalLM

    model_dir = _model(tmp_path / "model", tied)
    for world in (1, 2):
        cmd = [sys.executable, str(WORKER), str(model_dir), str(tmp_path / f"w{world}")]
        if world > 1:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), *cmd[1:]]
        proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    reference.save_pretrained(tmp_path / "hf")
    expected = _tensors(tmp_path / "hf")
    assert ("lm_head.weight" in expected) is (not tied)
    one, two = _tensors(tmp_path / "w1" / "published"), _tensors(tmp_path / "w2" / "published")
    assert one.keys() == two.keys() == expected.keys()
    for k in expected:
        assert one[k].dtype == torch.bfloat16
        assert torch.equal(one[k], expected[k]), k
        assert torch.equal(two[k], expected[k]), k
    for world in (1, 2):
        folder = tmp_path / f"w{world}" / "published"
        cfg = json.loads((folder / "config.json").read_text())
        assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"
        assert cfg["tie_word_embeddings"] is tied
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(expected)
        assert (folder / "tokenizer_config.json").is_file()
        reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)  # what an engine loads
        for k, v in reloaded.state_dict().items():
            ref = reference.state_dict()[k]
            assert torch.equal(v, ref), k
