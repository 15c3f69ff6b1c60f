"""``splice init-model``: heads every engine can serve, and the format warm start."""

from __future__ import annotations

import json

import pytest

from engines.reference import model_init


def test_default_model_has_64_wide_heads(tmp_path, monkeypatch):
    monkeypatch.setenv("SPLICE_HOME", str(tmp_path / "home"))
    path = model_init.ensure_model()
    cfg = model_init.read_config(path)
    assert cfg["head_dim"] == 64 and cfg["hidden_size"] == 64 and cfg["num_hidden_layers"] == 2
    assert path.name.startswith("tiny-qwen3-hd64")  # a cached head_dim-16 model is never picked up
    assert model_init.ensure_model() == path  # created once


def test_cli_flags_and_warm_start(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = tmp_path / "ws.jsonl"
    prompt = "<|im_start|>user\nsay ok<|im_end|>\n<|im_start|>assistant\n"
    data.write_text("".join(json.dumps({"prompt": prompt, "completion": "ok<|im_end|>"}) + "\n" for _ in range(4)))
    out = tmp_path / "m"
    assert model_init.main([str(out), "--head-dim", "128", "--heads", "2", "--kv-heads", "1", "--hidden-size", "32",
                            "--warm-start", str(data), "--warm-start-steps", "25", "--warm-start-batch", "2"]) == 0
    cfg = model_init.read_config(out)
    assert (cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]) == (128, 2, 1, 32)

    tok = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    target = tok("ok<|im_end|>", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids + target])).logits[0]
    lp = torch.log_softmax(logits.double(), -1)
    learned = sum(lp[len(ids) - 1 + j, t].item() for j, t in enumerate(target))
    assert learned > -2.0  # from ~-25 (random over 151936 tokens): the completion was learned


def test_warm_start_rejects_bad_rows(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        model_init.read_warm_start(bad)
    with pytest.raises(SystemExit):
        model_init.main([str(tmp_path / "m"), "--heads", "3", "--kv-heads", "2"])
