"""Fixtures: the tiny Qwen2.5-VL model, an engine serving it over loopback, and an oracle.

The oracle (``helpers.VisionOracle``) is independent of the engine's code: it runs the folder's
image processor itself and a full (no-cache) float64 forward of
``Qwen2_5_VLForConditionalGeneration`` with the pixels, the image grids and the image token
types, so the model computes its own M-RoPE positions (``get_rope_index``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engines.reference.testing import start_engine_in_thread
from engines.reference.vision_files import init_vision_model
from tests.engines.reference_vision.helpers import VisionOracle, png

TOKEN_DELAY_S = 0.01


@pytest.fixture(scope="session")
def vision_dir(tmp_path_factory):
    torch.set_num_threads(1)
    return init_vision_model(tmp_path_factory.mktemp("tiny-qwen25vl"), seed=0)


@pytest.fixture(scope="session")
def perturbed_vision_dir(vision_dir, tmp_path_factory):
    """A copy of the weights with seeded noise (stands in for a trained checkpoint)."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("tiny-qwen25vl-v1")
    for f in Path(vision_dir).iterdir():
        if f.suffix != ".safetensors":
            shutil.copyfile(f, out / f.name)
    gen = torch.Generator().manual_seed(1)
    tensors = load_file(str(Path(vision_dir) / "model.safetensors"))
    noisy = {k: (v + 0.2 * torch.randn(v.shape, generator=gen) * v.float().std().clamp_min(1e-3)).contiguous() for k, v in tensors.items()}
    save_file(noisy, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="session")
def oracle(vision_dir):
    return VisionOracle(vision_dir)


@pytest.fixture(scope="session")
def oracle_v1(perturbed_vision_dir):
    return VisionOracle(perturbed_vision_dir)


@pytest.fixture(scope="session")
def vengine(vision_dir):
    """Base URL of an engine serving the vision model (in a thread), 10 ms per token."""
    url, stop = start_engine_in_thread(vision_dir, token_delay_s=TOKEN_DELAY_S, weight_version="0", served_model_name="tiny-vl")
    yield url
    stop()


@pytest.fixture(scope="session")
def images():
    """Two small distinct images: 150x100 (20 placeholder tokens) and 60x90 (6)."""
    return [png(150, 100, 0), png(60, 90, 1)]


