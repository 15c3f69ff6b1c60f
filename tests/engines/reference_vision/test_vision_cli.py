"""``splice init-model --vision DIR`` writes a folder the engine serves as a vision model."""

from __future__ import annotations

import json

import pytest

from engines.reference.lm import is_vision_model_dir
from engines.reference.vision_files import IMAGE_PAD_ID
from proxy.cli import main as splice


def test_init_model_vision_writes_a_qwen25_vl_folder(tmp_path, vision_dir):
    out = tmp_path / "vl"
    assert splice(["init-model", "--vision", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "qwen2_5_vl" and cfg["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert cfg["image_token_id"] == IMAGE_PAD_ID and is_vision_model_dir(out)
    pre = json.loads((out / "preprocessor_config.json").read_text())
    assert pre["image_processor_type"] == "Qwen2VLImageProcessor" and pre["merge_size"] == 2
    # seed 0 by default: the same weights as the fixture's init_vision_model(seed=0)
    assert (out / "model.safetensors").read_bytes() == (vision_dir / "model.safetensors").read_bytes()


def test_init_model_vision_refuses_text_only_options(tmp_path):
    with pytest.raises(SystemExit):
        splice(["init-model", "--vision", "--perturb-from", str(tmp_path), str(tmp_path / "x")])


def test_text_model_folder_is_not_a_vision_one(tmp_path):
    from engines.reference.model_init import init_model

    assert not is_vision_model_dir(init_model(tmp_path / "text", seed=0))
