"""``export.save_engine_dir`` in one process: the folder transformers would write, bucket files,
and a failure that leaves nothing behind (the multi-rank case is test_sharded_publish.py)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from trainer_bridge import export
from trainer_bridge.distributed import Dist


def _tied_model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(3)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=97, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                        tie_word_embeddings=True))


def test_buckets_hold_what_save_pretrained_writes(tmp_path):
    model = _tied_model()
    model.to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    model.float()
    rep = export.save_engine_dir(model, Dist(), None, tmp_path / "ours", dtype="bfloat16", bucket_mb=0.004)
    expected = load_file(tmp_path / "hf" / "model.safetensors")
    files = sorted((tmp_path / "ours").glob("model-*.safetensors"))
    assert rep.files == len(files) > 1
    got = {}
    for f in files:
        part = load_file(f)
        assert not got.keys() & part.keys()
        got.update(part)
    assert got.keys() == expected.keys() and "lm_head.weight" not in got
    for k, v in expected.items():
        assert torch.equal(got[k], v), k
    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == rep.bytes == sum(v.numel() * 2 for v in expected.values())
    assert not (tmp_path / ".ours.tmp").exists()


def test_a_failed_write_leaves_nothing(tmp_path):
    (tmp_path / "blocker").write_text("a file where the folder's parent should be")
    with pytest.raises(OSError):
        export.save_engine_dir(_tied_model(), Dist(), None, tmp_path / "blocker" / "step_1", dtype="bfloat16")
    assert (tmp_path / "blocker").is_file()
