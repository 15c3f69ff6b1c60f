"""A vision model's turns ask the engine never to sample a vision token, and a turn whose output
holds one anyway (an engine that ignored the ban) is recorded untrainable and its sample is not
trained on; a text model's turns carry no ban at all."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

from engines.reference.vision_files import IMAGE_PAD_ID, write_vision_processor_files
from proxy.app import create_app
from proxy.settings import Settings
from proxy.store import Store
from tests.fakes.engines import FixedPool
from tokenization import ChatFormat, load_tokenizer, qwen3_tokenizer_dir
from tokenization.vision import VisionSpec


class RecordingPool(FixedPool):
    def __init__(self, ids):
        super().__init__(ids)
        self.params = []
        self.images = []

    async def generate(self, input_ids, params, *, session_id, on_tokens=None, images=()):
        self.params.append(params)
        self.images.append(list(images))
        return await super().generate(input_ids, params, session_id=session_id, on_tokens=on_tokens, images=images)


def _image_url() -> str:
    buf = io.BytesIO()
    Image.fromarray((np.random.RandomState(3).rand(60, 90, 3) * 255).astype("uint8")).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _client(tmp_path, fmt, ids):
    pool = RecordingPool(ids)
    app = create_app(Settings(store=str(tmp_path / "s.sqlite"), max_context=8192), fmt=fmt, pool=pool)
    return app, pool


@pytest.fixture(scope="module")
def vision_fmt(tmp_path_factory):
    folder = write_vision_processor_files(tmp_path_factory.mktemp("vl"))
    tok = load_tokenizer(str(folder))
    return ChatFormat(tok, None, vision=VisionSpec.from_model_dir(folder, tok))


@pytest.mark.parametrize("sampled_pad", [False, True])
def test_vision_turns_carry_the_ban_and_a_banned_output_is_untrainable(tmp_path, vision_fmt, sampled_pad):
    tok = vision_fmt.tokenizer
    ids = tok.encode("Clicked.", add_special_tokens=False) + ([IMAGE_PAD_ID] if sampled_pad else []) + [151645]
    app, pool = _client(tmp_path, vision_fmt, ids)
    body = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What now?"}, {"type": "image_url", "image_url": {"url": _image_url()}}]}]}  # fmt: skip
    with TestClient(app) as c:
        r = c.post("/v1/chat/completions", json=body, headers={"X-Session-Id": "s"})
        assert r.status_code == 200, r.text
        assert c.post("/v1/sessions/s/reward", json={"reward": 1.0}).status_code == 200
        pulled = c.post("/v1/trajectories/pull", json={"max_samples": 4}).json()
    (params,) = pool.params
    assert set(params.banned_token_ids) == {151652, 151653, 151654, 151655, 151656}
    assert len(pool.images[0]) == 1 and pool.images[0][0].length > 1
    with Store(str(tmp_path / "s.sqlite")) as st:
        (turn,) = st.turns.list("s")
    assert turn.requested_sampling.get("trainable") is (False if sampled_pad else True)
    assert (turn.requested_sampling.get("untrainable_reason") == "sampled_banned_token") is sampled_pad
    (sample,) = pulled["samples"]
    assert sample["trainable"] is (not sampled_pad)


def test_text_model_turns_carry_no_ban(tmp_path):
    tok = load_tokenizer(str(qwen3_tokenizer_dir()))
    app, pool = _client(tmp_path, ChatFormat(tok, "qwen3"), tok.encode("ok<|im_end|>", add_special_tokens=False))
    with TestClient(app) as c:
        assert c.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}).status_code == 200
    assert pool.params[0].banned_token_ids == () and pool.images == [[]]
