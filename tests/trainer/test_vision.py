"""The trainer on samples with images (a tiny random Qwen2.5-VL-architecture model).

References are independent of the trainer's code: the plain transformers model run on the image
processor's own pixels, with the model computing its M-RoPE positions itself (``mm_token_type_ids``)
and a float64 log-softmax over the vocabulary without the banned vision ids. Images are PNG bytes
served over real HTTP (``GET /v1/images/{hash}`` with a bearer token, as the proxy serves them).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pyarrow as pa
import pytest
import torch
from PIL import Image

from engines.reference.vision_files import ensure_vision_model
from trainer_bridge.batching import empty_micro_batch, pack
from trainer_bridge.client import ProxyClient, ProxyError, read_arrow_samples
from splice_trainer_testlib import SYNTHETIC_GUARDS_OFF
from trainer_bridge.config import TrainConfig
from trainer_bridge.distributed import Dist
from trainer_bridge.image_fetch import ImageSource
from trainer_bridge.learner import build_learner, learner_step, pack_share, policy_inputs
from trainer_bridge.logprobs import token_logprobs_and_entropy
from trainer_bridge.train import prepare_batch
from trainer_bridge.vision import IMAGE_DATA_KEY, ImageInputError, PixelCache, VisionSettings, batch_pixels

TOKEN = "admin-secret"
IMAGE_PAD, VISION_START, VISION_END = 151655, 151652, 151653
BANNED = [151652, 151653, 151654, 151655, 151656]


# -- fixtures: the model, images, an image server -------------------------------------------------


@pytest.fixture(scope="module")
def vl_dir():
    return ensure_vision_model()


@pytest.fixture(scope="module")
def processor(vl_dir):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    cfg = json.loads((vl_dir / "preprocessor_config.json").read_text())
    return Qwen2VLImageProcessorPil(**{k: v for k, v in cfg.items() if k not in ("image_processor_type", "processor_class")})


def png(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def content_hash(data: bytes) -> str:
    img = Image.open(io.BytesIO(data)).convert("RGB")
    return hashlib.sha256(f"RGB:{img.width}x{img.height}:".encode() + img.tobytes()).hexdigest()


@pytest.fixture(scope="module")
def images(processor):
    """hash -> (png bytes, grid by the model's processor)."""
    out = {}
    for w, h, seed in [(150, 100, 1), (90, 60, 2), (120, 120, 3), (70, 130, 4)]:
        data = png(w, h, seed)
        grid = processor(images=[Image.open(io.BytesIO(data))], return_tensors="np")["image_grid_thw"][0]
        out[content_hash(data)] = (data, [int(g) for g in grid])
    return out


class _ImageHandler(BaseHTTPRequestHandler):
    store: dict[str, bytes] = {}
    requests: list[str] = []

    def do_GET(self):  # noqa: N802 - http.server's name
        self.requests.append(self.path)
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self._error(401, "invalid admin token")
        prefix = "/v1/images/"
        data = self.store.get(self.path[len(prefix):]) if self.path.startswith(prefix) else None
        if data is None:
            return self._error(404, "no such image")
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status, message):
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "code": None}}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_server(images):
    handler = type("Handler", (_ImageHandler,), {"store": {h: d for h, (d, _) in images.items()}, "requests": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()
    server.server_close()


@pytest.fixture()
def client(image_server):
    with ProxyClient(image_server[0], admin_token=TOKEN, max_retries=0) as c:
        yield c


def vl_sample(sample_id: str, picks: list[tuple[str, list[int]]], seed: int, n_out: int = 12, reward: float = 1.0) -> dict:
    """A chat-shaped sample: user turn with the images (expanded spans) and text, then an answer."""
    rng = np.random.default_rng(seed)
    ids = [151644, 872, 198]
    refs = []
    for h, grid in picks:
        n = int(np.prod(grid)) // 4
        ids.append(VISION_START)
        refs.append({"hash": h, "offset": len(ids), "length": n, "grid_thw": list(grid)})
        ids += [IMAGE_PAD] * n + [VISION_END]
        ids += rng.integers(100, 150_000, 3).tolist()
    ids += [151645, 198, 151644, 77091, 198]
    prompt = len(ids)
    ids += rng.integers(100, 150_000, n_out).tolist() + [151645]
    n = len(ids)
    mask = [0] * prompt + [1] * (n - prompt)
    lp = [0.0] * prompt + (-rng.uniform(0.5, 5.0, n - prompt)).tolist()
    return {"sample_id": sample_id, "session_id": sample_id.split(":")[0], "group_id": "g", "reward": reward,
            "input_ids": ids, "loss_mask": mask, "logprobs": lp, "versions": [-1] * prompt + [5] * (n - prompt),
            "proximal_logprobs_t": list(lp), "proximal_versions": [-1] * prompt + [5] * (n - prompt), "images": refs}


def learner_for(vl_dir, tmp_path, **kw):
    cfg = TrainConfig(**SYNTHETIC_GUARDS_OFF, proxies=["http://unused"], model=str(vl_dir), out=str(tmp_path), progress=False,
                      max_grad_norm=None, micro_batch_tokens=4096, **kw)
    return build_learner(cfg, Dist()), cfg


def reference_logprobs(vl_dir, processor, sample, images) -> torch.Tensor:
    """The plain HF model on the processor's pixels; float64 log-softmax over the unbanned vocabulary."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(vl_dir, dtype=torch.float32).eval()
    pil = [Image.open(io.BytesIO(images[r["hash"]][0])) for r in sample["images"]]
    out = processor(images=pil, return_tensors="pt")
    ids = torch.tensor([sample["input_ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"],
                       mm_token_type_ids=(ids == IMAGE_PAD).int(), use_cache=False).logits[0].double()
    allowed = torch.ones(logits.shape[-1], dtype=torch.bool)
    allowed[BANNED] = False
    logp = torch.full_like(logits, float("-inf"))
    logp[:, allowed] = torch.log_softmax(logits[:, allowed], dim=-1)
    picked = logp[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros(1, dtype=torch.float64), picked])


def trainer_logprobs(learner, samples, *, rows="one", all_tokens=True):
    learner.pack_rows = rows
    mb = pack_share(learner, samples, [1.0] * len(samples))
    inputs = policy_inputs(mb)
    if all_tokens:
        inputs["loss_mask"] = None
    with torch.no_grad():
        lp, _ = learner.module(**inputs)
    out = []
    for b, index in enumerate(mb.sample_indices):
        where = mb.seq_ids == b
        out.append((index, lp[where]))
    return [lp for _, lp in sorted(out, key=lambda x: x[0])], mb


def assert_logprobs_equal(got: torch.Tensor, ref: torch.Tensor, atol=5e-5):
    assert got.shape == ref.shape
    inf = torch.isinf(ref)
    assert torch.equal(torch.isinf(got), inf)  # banned targets (the image pads) are -inf on both sides
    assert inf.any() and (~inf).sum() > 10
    torch.testing.assert_close(got[~inf].double(), ref[~inf], atol=atol, rtol=0)


# -- (a) two images: trainer log-probs equal the model's own forward ----------------------------


def test_two_image_sample_matches_the_model_on_the_processor_pixels(vl_dir, processor, images, client, image_server, tmp_path):
    (h1, (_, g1)), (h2, (_, g2)) = list(images.items())[:2]
    sample = vl_sample("s1:0", [(h1, g1), (h2, g2)], seed=1)
    learner, _ = learner_for(vl_dir, tmp_path)
    source = ImageSource(learner.vision, client.image_bytes)
    before = len(image_server[1].requests)
    assert source.attach([sample, dict(sample, sample_id="s1:1")]) == 4
    assert len(image_server[1].requests) - before == 2  # once per hash, not per reference
    assert source.attach([dict(sample)]) == 2 and len(image_server[1].requests) - before == 2  # cached

    (got,), mb = trainer_logprobs(learner, [sample])
    assert mb.image_grid_thw.tolist() == [g1, g2]
    ref = reference_logprobs(vl_dir, processor, sample, images)
    assert_logprobs_equal(got, ref)
    # the loss tokens alone (the training path) give the same values there
    with torch.no_grad():
        lp, _ = learner.module(**policy_inputs(mb))
    loss = mb.loss_mask[0].bool()
    torch.testing.assert_close(lp[0][loss].double(), ref[loss], atol=5e-5, rtol=0)
    assert torch.isfinite(lp).all()
    # positions computed once at packing time or by the policy itself: the same
    inputs = policy_inputs(mb)
    assert inputs.pop("rope_position_ids").shape == (4, *mb.input_ids.shape)
    with torch.no_grad():
        again, _ = learner.module(**inputs)
    assert torch.equal(again, lp)


def test_positions_are_m_rope_not_1d(vl_dir, processor, images, client, tmp_path):
    """Without the model's M-RoPE index the values differ a lot: the check above can fail."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    (h1, (_, g1)), = list(images.items())[:1]
    sample = vl_sample("s9:0", [(h1, g1)], seed=9)
    learner, _ = learner_for(vl_dir, tmp_path)
    ImageSource(learner.vision, client.image_bytes).attach([sample])
    (got,), _ = trainer_logprobs(learner, [sample])
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(vl_dir, dtype=torch.float32).eval()
    out = processor(images=[Image.open(io.BytesIO(images[h1][0]))], return_tensors="pt")
    ids = torch.tensor([sample["input_ids"]])
    with torch.no_grad():  # no mm_token_type_ids: transformers falls back to 1-D positions
        logits = model(input_ids=ids, pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"],
                       use_cache=False).logits[0].double()
    flat = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    tail = slice(len(ids[0]) - 10, None)
    assert (got[tail].double() - flat[-10:]).abs().max() > 1e-2


# -- (b) packing: each sample as if alone ----------------------------------------------------------


@pytest.mark.parametrize("rows", ["one", "longest"])
def test_packed_image_samples_equal_each_alone(vl_dir, processor, images, client, tmp_path, rows):
    items = list(images.items())
    a = vl_sample("a:0", [(items[0][0], items[0][1][1]), (items[1][0], items[1][1][1])], seed=2)
    b = vl_sample("b:0", [(items[2][0], items[2][1][1])], seed=3, n_out=20)
    c = vl_sample("c:0", [(items[3][0], items[3][1][1]), (items[0][0], items[0][1][1])], seed=4, n_out=5)
    learner, _ = learner_for(vl_dir, tmp_path)
    ImageSource(learner.vision, client.image_bytes).attach([a, b, c])
    packed, mb = trainer_logprobs(learner, [a, b, c], rows=rows)
    assert mb.pixel_values is not None and len(mb.image_grid_thw) == 5
    if rows == "longest":
        assert mb.input_ids.shape[0] > 1  # several rows: images still in token (row-major) order
    for sample, got in zip([a, b, c], packed):
        (alone,), _ = trainer_logprobs(learner, [sample])
        assert_logprobs_equal(got, alone.double())
        assert_logprobs_equal(got, reference_logprobs(vl_dir, processor, sample, images))


def test_text_only_micro_batch_and_image_free_sample(vl_dir, tmp_path):
    """A sample without images in a vision policy: plain positions, the vision tower run times 0."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    learner, _ = learner_for(vl_dir, tmp_path)
    text = vl_sample("t:0", [], seed=5)
    (got,), mb = trainer_logprobs(learner, [text])
    assert mb.pixel_values is None
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(vl_dir, dtype=torch.float32).eval()
    ids = torch.tensor([text["input_ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0].double()
    logits[:, BANNED] = float("-inf")
    ref = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    torch.testing.assert_close(got[1:].double(), ref, atol=5e-5, rtol=0)


# -- (c) placeholder drift: clear errors ----------------------------------------------------------


def test_grid_mismatch_is_a_clear_error(vl_dir, images, client, tmp_path):
    settings = VisionSettings.from_model_dir(vl_dir)
    (h1, (data, g1)), = list(images.items())[:1]
    wrong = [1, g1[1] + 2, g1[2]]  # what a processor with other pixel limits might have recorded
    sample = vl_sample("d:0", [(h1, wrong)], seed=6)
    with pytest.raises(ImageInputError, match=r"recorded with grid_thw \[1, 10, 10\].*gives \[1, 8, 10\].*max_pixels"):
        ImageSource(settings, client.image_bytes).attach([sample])
    # the per-rank pixel cache checks the processor's own output too
    sample[IMAGE_DATA_KEY] = {h1: data}
    with pytest.raises(ImageInputError, match="grid_thw"):
        batch_pixels([sample], PixelCache(settings))


def test_other_processor_settings_are_caught(vl_dir, client, images):
    """A trainer whose max_pixels differs from the proxy's: a big screenshot expands differently."""
    settings = VisionSettings.from_model_dir(vl_dir)
    small = dataclasses.replace(settings, max_pixels=64 * 28 * 28,
                                processor_kwargs={**settings.processor_kwargs, "max_pixels": 64 * 28 * 28,
                                                  "size": {"shortest_edge": settings.min_pixels, "longest_edge": 64 * 28 * 28}})
    data = png(640, 400, 7)
    h = content_hash(data)
    grid = list(settings.grid_for_size(640, 400))
    assert grid != list(small.grid_for_size(640, 400))
    sample = vl_sample("e:0", [(h, grid)], seed=7)
    source = ImageSource(small, lambda _: data)
    with pytest.raises(ImageInputError, match="process images differently"):
        source.attach([sample])
    sample[IMAGE_DATA_KEY] = {h: data}
    with pytest.raises(ImageInputError, match="grid_thw"):
        batch_pixels([sample], PixelCache(small))
    assert ImageSource(settings, lambda _: data).attach([vl_sample("e:1", [(h, grid)], seed=7)]) == 1


def test_span_errors(vl_dir, images):
    settings = VisionSettings.from_model_dir(vl_dir)
    (h1, (data, g1)), = list(images.items())[:1]
    source = ImageSource(settings, lambda _: data)
    sample = vl_sample("f:0", [(h1, g1)], seed=8)
    bad_len = json.loads(json.dumps(sample))
    bad_len["images"][0]["length"] -= 1
    with pytest.raises(ImageInputError, match="spans 19 tokens but its grid \\[1, 8, 10\\] gives 20"):
        source.attach([bad_len])
    shifted = json.loads(json.dumps(sample))
    shifted["images"][0]["offset"] -= 1
    with pytest.raises(ImageInputError, match="tokens other than <\\|image_pad\\|>"):
        source.attach([shifted])


def test_missing_image_and_bad_token(vl_dir, client, image_server):
    with pytest.raises(ProxyError) as e:
        client.image_bytes("0" * 64)
    assert e.value.status == 404 and "no such image" in str(e.value)
    with ProxyClient(image_server[0], admin_token="wrong", max_retries=0) as bad:
        with pytest.raises(ProxyError) as e:
            bad.image_bytes("0" * 64)
    assert e.value.status == 401


# -- (d) the ban: log-softmax over the reduced vocabulary ------------------------------------------


def test_ban_is_log_softmax_over_the_reduced_vocabulary():
    torch.manual_seed(0)
    vocab, banned = 50, torch.tensor([3, 7, 11, 49])
    h = torch.randn(2, 13, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(vocab, 8, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, vocab, (2, 13))
    ids[0, 4], ids[1, 9] = 7, 49  # banned targets
    lp, ent = token_logprobs_and_entropy(h, ids, w, temperature=0.7, chunk_size=5, banned_ids=banned)
    plain, _ = token_logprobs_and_entropy(h, ids, w, temperature=0.7, chunk_size=5)

    allowed = torch.ones(vocab, dtype=torch.bool)
    allowed[banned] = False
    logits = (h @ w.T / 0.7)[:, :-1]
    reduced = torch.log_softmax(logits[..., allowed], dim=-1)  # the formula, float64
    full = torch.full_like(logits, float("-inf"))
    full[..., allowed] = reduced
    ref = torch.cat([torch.zeros(2, 1, dtype=torch.float64), full.gather(-1, ids[:, 1:, None]).squeeze(-1)], 1)
    ref_ent = torch.cat([torch.zeros(2, 1, dtype=torch.float64), -(reduced.exp() * reduced).sum(-1)], 1)

    is_banned = torch.isin(ids, banned)
    is_banned[:, 0] = False
    assert torch.isinf(lp[is_banned]).all() and torch.isfinite(lp[~is_banned]).all()
    torch.testing.assert_close(lp[~is_banned], ref[~is_banned], atol=1e-12, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-12, rtol=0)
    keep = ~is_banned
    keep[:, 0] = False
    # the ban shifts each allowed log-prob by -log(1 - p(banned)) under the full softmax
    p_banned = torch.softmax(logits, -1)[..., banned].sum(-1)
    shift = -torch.log1p(-p_banned)
    torch.testing.assert_close((lp - plain)[:, 1:][keep[:, 1:]], shift[keep[:, 1:]], atol=1e-12, rtol=0)
    assert shift.min() > 1e-6
    # gradients through the allowed targets equal the formula's
    g1 = torch.autograd.grad(lp[keep].sum(), (h, w))
    g2 = torch.autograd.grad(ref[keep].sum(), (h, w))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


def test_sampled_vision_token_drops_the_sample(vl_dir, images):
    settings = VisionSettings.from_model_dir(vl_dir)
    assert set(settings.banned_ids) == set(BANNED)
    (h1, (_, g1)), = list(images.items())[:1]
    good = vl_sample("g:0", [(h1, g1)], seed=10, reward=1.0)
    sampled_pad = vl_sample("g2:0", [(h1, g1)], seed=11, reward=0.0)
    sampled_pad["input_ids"][-3] = IMAGE_PAD  # a loss token
    stray = vl_sample("g3:0", [(h1, g1)], seed=12, reward=0.5)
    stray["input_ids"][-3] = VISION_START
    stray["loss_mask"][-3] = 0  # kept as context by the proxy (turn marked untrainable): still dropped
    stray["input_ids"][-5] = IMAGE_PAD
    stray["loss_mask"][-5] = 0
    cfg = TrainConfig(proxies=["x"], model=str(vl_dir))
    kept, adv, info = prepare_batch([good, sampled_pad, stray], 5, cfg, settings)
    assert [s["sample_id"] for s in kept] == ["g:0"] and info["n_dropped_banned_token"] == 2
    assert adv[0] > 0  # advantages still over the whole group
    with pytest.raises(ImageInputError, match="not a vision model"):
        prepare_batch([good], 5, cfg, None)


# -- (e) a training step --------------------------------------------------------------------------


def test_training_step_gives_finite_vision_grads(vl_dir, images, client, tmp_path):
    items = list(images.items())
    samples = [vl_sample("h:0", [(items[0][0], items[0][1][1]), (items[1][0], items[1][1][1])], seed=13, reward=1.0),
               vl_sample("h2:0", [(items[2][0], items[2][1][1])], seed=14, reward=0.0)]
    for s in samples:
        s["group_id"] = "h"
    learner, cfg = learner_for(vl_dir, tmp_path, lr=1e-3, ppo_n_minibatches=2)
    kept, adv, _ = prepare_batch(samples, 5, cfg, learner.vision)
    ImageSource(learner.vision, client.image_bytes).attach(kept)
    named = dict(learner.policy.model.named_parameters())
    vision = {k: v.full_tensor().clone() for k, v in named.items() if ".visual." in k or k.startswith("model.visual")}
    assert any(".blocks." in k for k in vision) and any("patch_embed" in k for k in vision)
    stats = learner_step(learner, kept, adv, cfg, step=1, version=5)
    assert np.isfinite(stats["loss"]) and stats["loss_tokens"] > 0 and stats["n_minibatches"] == 2
    grads = {k: named[k].grad.full_tensor() for k in vision}
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert any(g.abs().sum() > 0 for k, g in grads.items() if ".blocks." in k)
    changed = [k for k in vision if not torch.equal(named[k].full_tensor(), vision[k])]
    assert any(".blocks." in k for k in changed) and any("patch_embed" in k for k in changed)


def test_filler_micro_batch_runs_the_vision_tower(vl_dir, tmp_path):
    """A rank with nothing to do still runs every FSDP unit (vision blocks included), at zero weight."""
    learner, _ = learner_for(vl_dir, tmp_path)
    mb = empty_micro_batch()
    lp, _ = learner.module(**policy_inputs(mb))
    (lp * mb.loss_mask).sum().backward()
    grads = [p.grad for k, p in learner.policy.model.named_parameters() if ".blocks." in k and "visual" in k]
    assert grads and all(g is not None and float(g.full_tensor().abs().sum()) == 0.0 for g in grads)


# -- the wire: image references in an Arrow pull -----------------------------------------------------


def test_arrow_pull_carries_image_references():
    refs = [{"hash": "ab" * 32, "offset": 4, "length": 20, "grid_thw": [1, 8, 10]}]
    images_type = pa.list_(pa.struct([("hash", pa.string()), ("offset", pa.int32()), ("length", pa.int32()),
                                      ("grid_thw", pa.list_(pa.int32()))]))
    table = pa.table({"sample_id": ["s:0"], "input_ids": pa.array([[1, 2, 3]], pa.list_(pa.int32())),
                      "images": pa.array([refs], images_type)})
    table = table.replace_schema_metadata({"splice.schema_version": "3"})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    _, (sample,) = read_arrow_samples(sink.getvalue().to_pybytes())
    assert sample["images"] == refs
    assert pack([dict(sample, loss_mask=[0, 1, 1], logprobs=[0, -1, -1], versions=[-1, 1, 1],
                      proximal_logprobs_t=[0, -1, -1], proximal_versions=[-1, 1, 1])], [0], [1.0]).input_ids.shape == (1, 3)


# -- the whole loop: pull, fetch once per hash, step, publish ---------------------------------------


class ImageProxy:
    """The ProxyClient methods train() uses, plus the image route (images from ``store``)."""

    def __init__(self, batches, store):
        self.batches, self.store, self._version, self.fetched, self.published = list(batches), store, 5, [], []

    def version(self):
        return self._version

    def pull(self, max_samples, wait_s):
        batch = self.batches.pop(0) if self.batches else []
        return ("L" if batch else None), batch

    def ack(self, lease):
        pass

    def image_bytes(self, image_hash):
        self.fetched.append(image_hash)
        return self.store[image_hash]

    def publish(self, path, version):
        self.published.append(path)
        self._version = version


def test_train_loop_fetches_each_image_once_and_publishes_a_vision_folder(vl_dir, images, tmp_path):
    from safetensors import safe_open

    from trainer_bridge.train import train

    items = list(images.items())
    samples = [vl_sample("i:0", [(items[0][0], items[0][1][1]), (items[1][0], items[1][1][1])], seed=20, reward=1.0),
               vl_sample("i2:0", [(items[1][0], items[1][1][1])], seed=21, reward=0.0)]
    proxy = ImageProxy([samples], {h: d for h, (d, _) in images.items()})
    cfg = TrainConfig(**SYNTHETIC_GUARDS_OFF, proxies=["http://unused"], model=str(vl_dir), out=str(tmp_path / "run"), progress=False,
                      checkpoint_every=None, lr=1e-3, micro_batch_tokens=4096)
    (record,) = train(cfg, client=proxy)
    assert record["n_images"] == 3 and record["n_images_fetched"] == 2 and sorted(proxy.fetched) == sorted(
        [items[0][0], items[1][0]])
    assert np.isfinite(record["loss"]) and record["loss_tokens"] == sum(sum(s["loss_mask"]) for s in samples)
    step = tmp_path / "run" / "step_1"
    assert proxy.published == [str(step)]
    assert (step / "preprocessor_config.json").read_text() == (vl_dir / "preprocessor_config.json").read_text()
    new, old = safe_open(str(step / "model.safetensors"), "pt"), safe_open(str(vl_dir / "model.safetensors"), "pt")
    assert set(new.keys()) == set(old.keys())  # the checkpoint's own names: engines load it as before
    moved = [k for k in new.keys() if not torch.equal(new.get_tensor(k), old.get_tensor(k))]
    assert any(k.startswith("visual.blocks.") for k in moved) and any(k.startswith("model.layers.") for k in moved)
