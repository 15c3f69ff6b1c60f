"""Images end to end over real HTTP: a vision-language agent's screenshots through ``splice
serve`` and the reference engine serving a tiny Qwen2.5-VL model (real forward passes).

A four-turn session adds a new screenshot every turn while re-sending the history (as agents
do): every later turn is spliced, each image is stored once, each span has the image
processor's count. The behaviour log-probs equal an independent transformers forward on the
processor's pixels (M-RoPE via ``mm_token_type_ids``, vision ids banned), R2 across a weight
update gives the new weights' values (the next turn's own call and a prefill of an idle
session, both sending the images), and the trainer's log-probs of the pulled sample, with
images fetched from ``GET /v1/images/{hash}``, equal the engine's behaviour log-probs.
The three API dialects' image parts reach the same prompt.
"""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.e2e.conftest import kill_tree, start_proxy

pytestmark = pytest.mark.slow

PAD, START, END = 151655, 151652, 151653
BANNED = [151652, 151653, 151654, 151655, 151656]
SCRIPT = [f"Clicked button {k}.<|im_end|>" for k in range(1, 12)]
SIZES = [(150, 100), (96, 64), (120, 140), (80, 200)]


def _png(seed: int, size: tuple[int, int]) -> bytes:
    w, h = size
    buf = io.BytesIO()
    Image.fromarray((np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8")).save(buf, "PNG")
    return buf.getvalue()


def _url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    from engines.reference.vision_files import ensure_vision_model

    return ensure_vision_model(tmp_path_factory.mktemp("vl") / "tiny-vl")


@pytest.fixture(scope="module")
def v1(vl_dir, tmp_path_factory):
    from engines.reference.model_init import perturb_model

    return str(perturb_model(vl_dir, tmp_path_factory.mktemp("vlw") / "v1", seed=7, scale=0.05))


@pytest.fixture(scope="module")
def processor(vl_dir):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    cfg = json.loads((vl_dir / "preprocessor_config.json").read_text())
    return Qwen2VLImageProcessorPil(**{k: v for k, v in cfg.items() if k not in ("image_processor_type", "processor_class")})


@pytest.fixture(scope="module")
def proxy(tmp_path_factory, vl_dir):
    p = start_proxy(tmp_path_factory.mktemp("vlproxy"), str(vl_dir), script=SCRIPT, extra=["--admin-token", "adm"])
    yield p
    kill_tree(p)


ADMIN = {"Authorization": "Bearer adm"}


def _post(proxy, path, body, sid=None, headers=None):
    h = {**(headers or {}), **({"X-Session-Id": sid} if sid else {})}
    r = httpx.post(proxy.url + path, json=body, headers=h, timeout=180)
    assert r.status_code == 200, (path, r.status_code, r.text[:500])
    return r.json()


def _session(proxy, sid):
    return httpx.get(f"{proxy.url}/v1/sessions/{sid}", headers=ADMIN, timeout=60).json()


def _forward(model_dir, processor, ids, pngs) -> list[float]:
    """log pi(ids[i] | ids[:i]) for i >= 1: the plain HF model on the processor's pixels, the
    banned vision ids left out of a float64 log-softmax."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    kw = {}
    if pngs:
        out = processor(images=[Image.open(io.BytesIO(d)) for d in pngs], return_tensors="pt")
        kw = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
    with torch.no_grad():
        logits = model(input_ids=x, mm_token_type_ids=(x == PAD).int(), use_cache=False, **kw).logits[0].double()
    logits[:, BANNED] = float("-inf")
    lp = torch.log_softmax(logits, dim=-1)
    return [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]


def _chat_turns(proxy, sid, n, seed0=0):
    msgs, pngs = [], []
    for k in range(n):
        data = _png(seed0 + k, SIZES[k % len(SIZES)])
        pngs.append(data)
        msgs.append({"role": "user", "content": [{"type": "text", "text": f"Screen {k}. What next?"},
                                                  {"type": "image_url", "image_url": {"url": _url(data)}}]})  # fmt: skip
        out = _post(proxy, "/v1/chat/completions", {"model": "m", "messages": msgs, "max_tokens": 32}, sid)
        msgs.append({"role": "assistant", "content": out["choices"][0]["message"]["content"]})
    return msgs, pngs


def test_screenshot_session_is_spliced_stored_once_and_exact(proxy, vl_dir, processor):
    from proxy.store import Store

    msgs, pngs = _chat_turns(proxy, "vl-a", 4)
    turns = _session(proxy, "vl-a")["turns"]
    assert [t["spliced"] for t in turns] == [False, True, True, True]
    assert all(t["fork_reason"] is None for t in turns)
    grids = [[int(g) for g in processor(images=[Image.open(io.BytesIO(d))], return_tensors="np")["image_grid_thw"][0]]
             for d in pngs]  # fmt: skip
    for k, t in enumerate(turns):
        refs = t["images"]
        assert [r["grid_thw"] for r in refs] == grids[: k + 1]
        for r in refs:  # each span sits between the vision markers with the processor's count
            assert r["length"] == int(np.prod(r["grid_thw"])) // 4
            ids = t["prompt_ids"]
            assert ids[r["offset"] - 1] == START and ids[r["offset"] + r["length"]] == END
            assert ids[r["offset"] : r["offset"] + r["length"]] == [PAD] * r["length"]
        assert t["prompt_ids"].count(PAD) == sum(r["length"] for r in refs)
        assert not set(BANNED) & set(t["output_ids"])
    with Store(proxy.store) as store:  # every turn re-sent the history's images: still 4 rows
        assert store.images.stats()["images"] == 4
    last = turns[-1]
    ids = last["prompt_ids"] + last["output_ids"]
    ref = _forward(vl_dir, processor, ids, pngs)
    start = len(last["prompt_ids"])
    assert last["output_logprobs"] == pytest.approx(ref[start - 1 :], abs=2e-4)
    # the stored bytes decode to the pixels that were sent
    r0 = last["images"][0]
    got = httpx.get(f"{proxy.url}/v1/images/{r0['hash']}", headers=ADMIN, timeout=30)
    assert got.status_code == 200
    assert Image.open(io.BytesIO(got.content)).tobytes() == Image.open(io.BytesIO(pngs[0])).convert("RGB").tobytes()
    assert httpx.get(f"{proxy.url}/v1/images/{r0['hash']}", timeout=30).status_code == 401


def test_three_dialects_render_the_same_image_prompt(proxy):
    data = _png(42, (64, 96))
    text = "Describe the screen."
    _post(proxy, "/v1/chat/completions", {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": _url(data)}}]}]}, "d-chat")  # fmt: skip
    _post(proxy, "/v1/responses", {"model": "m", "max_output_tokens": 8, "input": [{"role": "user", "content": [
        {"type": "input_text", "text": text}, {"type": "input_image", "image_url": _url(data)}]}]}, "d-resp")  # fmt: skip
    _post(proxy, "/v1/messages", {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "text", "text": text},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(data).decode()}}]}]},
        "d-anth")  # fmt: skip
    prompts = [_session(proxy, s)["turns"][0]["prompt_ids"] for s in ("d-chat", "d-resp", "d-anth")]
    assert prompts[0] == prompts[1] == prompts[2] and prompts[0].count(PAD) > 0


def test_bad_images_are_400_and_store_nothing(proxy):
    from proxy.store import Store

    with Store(proxy.store) as store:
        before = store.images.stats()
    for part, code in [
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}, "invalid_image"),
        ({"type": "image_url", "image_url": {"url": "https://example.com/x.png"}}, "image_url_not_allowed"),
    ]:
        r = httpx.post(proxy.url + "/v1/chat/completions", timeout=60, json={
            "model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, part]}]})  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text
    with Store(proxy.store) as store:
        assert store.images.stats() == before


def test_r2_across_an_update_sends_the_images(proxy, vl_dir, v1, processor):
    goes_on, pngs_a = _chat_turns(proxy, "vl-r2-on", 2, seed0=10)
    _idle, pngs_b = _chat_turns(proxy, "vl-r2-idle", 2, seed0=20)
    _post(proxy, "/admin/pause", {}, headers=ADMIN)
    _post(proxy, "/admin/update_weights", {"model_path": v1, "version": 1}, headers=ADMIN)
    _post(proxy, "/admin/resume", {}, headers=ADMIN)
    data = _png(30, (100, 100))
    goes_on.append({"role": "user", "content": [{"type": "text", "text": "And now?"},
                                                 {"type": "image_url", "image_url": {"url": _url(data)}}]})  # fmt: skip
    _post(proxy, "/v1/chat/completions", {"model": "m", "messages": goes_on, "max_tokens": 32}, "vl-r2-on")
    paused = _post(proxy, "/admin/pause", {}, headers=ADMIN)  # settles the idle session by a prefill
    assert paused["recompute"]["missing_tokens"] == 0 and paused["recompute"]["prefills"] >= 1
    _post(proxy, "/admin/resume", {}, headers=ADMIN)
    for sid, pngs in (("vl-r2-on", pngs_a + [data]), ("vl-r2-idle", pngs_b)):
        turns = _session(proxy, sid)["turns"]
        last = turns[-1]
        full = last["prompt_ids"] + last["output_ids"]
        ref = _forward(v1, processor, full, pngs[: len(last["images"])])
        for t in turns:
            if 0 not in t["versions"]:
                continue
            assert t["proximal_versions"] == [1] * len(t["output_ids"])
            s = len(t["prompt_ids"])
            assert t["proximal_logprobs_t"] == pytest.approx(ref[s - 1 : s - 1 + len(t["output_ids"])], abs=2e-4)
            assert max(abs(a - b) for a, b in zip(t["proximal_logprobs_t"], t["output_logprobs"])) > 1e-3


def test_trainer_logprobs_of_a_pulled_image_sample_equal_the_engines(proxy, vl_dir, v1, tmp_path):
    import torch

    from tests.trainer.test_vision import learner_for, trainer_logprobs
    from trainer_bridge.client import ProxyClient
    from trainer_bridge.image_fetch import ImageSource

    _chat_turns(proxy, "vl-train", 3, seed0=40)
    httpx.post(f"{proxy.url}/v1/sessions/vl-train/reward", json={"reward": 1.0}, headers=ADMIN, timeout=30).raise_for_status()
    with ProxyClient(proxy.url, admin_token="adm") as client:
        _lease, samples = client.pull(64)
        sample = next(s for s in samples if s["session_id"] == "vl-train")
        assert len(sample["images"]) == 3
        # the weights that sampled it (the R2 test may have moved the engine to version 1)
        (version,) = {v for v in sample["versions"] if v >= 0}
        learner, _ = learner_for({0: vl_dir, 1: v1}[version], tmp_path)
        ImageSource(learner.vision, client.image_bytes).attach([sample])
        (got,), _mb = trainer_logprobs(learner, [sample])
    mask = torch.as_tensor(np.asarray(sample["loss_mask"], dtype=bool))
    behaviour = torch.as_tensor(np.asarray(sample["logprobs"], dtype=np.float64))
    assert mask.sum() > 10
    torch.testing.assert_close(got[mask].double(), behaviour[mask], atol=2e-4, rtol=0)


def test_responses_previous_response_id_carries_history_images(proxy):
    """The stored conversation keeps image references, not bytes: the engine still gets the
    history's image, read back from the store by hash."""
    a, b = _png(50, (90, 60)), _png(51, (60, 90))
    first = _post(proxy, "/v1/responses", {"model": "m", "max_output_tokens": 16, "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "Open the page."}, {"type": "input_image", "image_url": _url(a)}]}]}, "vl-resp")  # fmt: skip
    second = _post(proxy, "/v1/responses", {"model": "m", "max_output_tokens": 16, "previous_response_id": first["id"],
                                            "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "Now this."}, {"type": "input_image", "image_url": _url(b)}]}]}, "vl-resp")  # fmt: skip
    assert second["status"] == "completed"
    turns = _session(proxy, "vl-resp")["turns"]
    assert [t["spliced"] for t in turns] == [False, True] and len(turns[1]["images"]) == 2
    assert turns[1]["images"][0] == turns[0]["images"][0]
