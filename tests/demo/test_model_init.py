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


def test_default_model_serves_agent_cli_prompts(tmp_path, monkeypatch):
    """Codex's first prompt is ~8k tokens and Claude Code's up to 21k: the default holds 128k,
    and the engine built on it reports that context the way SGLang and vLLM do."""
    from fastapi.testclient import TestClient

    from engines.reference.server import create_app

    monkeypatch.setenv("SPLICE_HOME", str(tmp_path / "home"))
    path = model_init.ensure_model()
    assert model_init.read_config(path)["max_position_embeddings"] >= 131072
    with TestClient(create_app(path, served_model_name="tiny")) as c:
        assert c.get("/server_info").json()["context_length"] >= 131072
        assert c.get("/v1/models").json()["data"][0]["max_model_len"] >= 131072
        # a 30k-token prompt is served (the 8k model answered 400 here)
        r = c.post("/generate", json={"input_ids": [9707] * 30000, "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200, r.text
        assert len(r.json()["output_ids"]) == 2


def test_stale_cached_default_model_is_rebuilt(tmp_path, monkeypatch):
    """A default model cached by an older release (8k context) is never silently reused; a model
    the user names is theirs and is used as it is."""
    monkeypatch.setenv("SPLICE_HOME", str(tmp_path / "home"))
    stale = model_init.default_model_dir()
    model_init.init_model(stale, max_position_embeddings=8192)
    assert model_init.read_config(model_init.ensure_model())["max_position_embeddings"] == 131072
    own = model_init.init_model(tmp_path / "own", max_position_embeddings=8192)
    assert model_init.read_config(model_init.ensure_model(own))["max_position_embeddings"] == 8192


def test_init_model_context_flag(tmp_path):
    assert model_init.main([str(tmp_path / "m"), "--max-position-embeddings", "262144"]) == 0
    assert model_init.read_config(tmp_path / "m")["max_position_embeddings"] == 262144
    with pytest.raises(SystemExit):
        model_init.main([str(tmp_path / "x"), "--max-position-embeddings", "0"])


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
