"""The planner places a conversation's images: a full render finds each image's expanded
span, a spliced turn keeps its parent's images where they were and adds the new messages'
ones after them. Checked against the image processor's own expansion (``Qwen2VLImageProcessorPil``
+ the processor's text expansion) and the model's chat template."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from PIL import Image

from engines.reference.vision_files import IMAGE_PAD_ID, VISION_START_ID, write_vision_processor_files
from proxy.session.planner import RenderError, plan
from proxy.store import ImageRef
from tests.proxy.session.test_planner import MemoryLookup, _req
from tokenization import ChatFormat, Message, load_tokenizer
from tokenization.vision import ImageCache, VisionSpec


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_vision_processor_files(tmp_path_factory.mktemp("vlproc"))


@pytest.fixture(scope="module")
def fmt(folder):
    tok = load_tokenizer(str(folder))
    return ChatFormat(tok, None, vision=VisionSpec.from_model_dir(folder, tok))


@pytest.fixture(scope="module")
def reference(folder):
    """The real processor's expansion, built without torchvision (tests only)."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    cfg = json.loads((folder / "preprocessor_config.json").read_text())
    p = Qwen2_5_VLProcessor.__new__(Qwen2_5_VLProcessor)
    p.image_processor = Qwen2VLImageProcessorPil(**{k: v for k, v in cfg.items() if k not in ("image_processor_type", "processor_class")})
    p.tokenizer = AutoTokenizer.from_pretrained(str(folder))
    p.video_processor, p.chat_template = None, (folder / "chat_template.jinja").read_text()
    p.image_token, p.video_token, p.image_token_id, p.video_token_id = "<|image_pad|>", "<|video_pad|>", IMAGE_PAD_ID, 151656

    def ids(messages, pils):
        text = p.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, chat_template=p.chat_template)
        out = p(text=[text], images=pils or None, return_tensors="np")
        grids = [tuple(int(x) for x in g) for g in out["image_grid_thw"]] if pils else []
        return [int(x) for x in out["input_ids"][0]], grids

    return ids


def _png(seed: int, w: int, h: int) -> tuple[bytes, Image.Image]:
    arr = (np.random.RandomState(seed).rand(h, w, 3) * 255).astype("uint8")
    im = Image.fromarray(arr)
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue(), im


class ImageLookup(MemoryLookup):
    def __init__(self):
        super().__init__()
        self.images: dict[str, tuple[ImageRef, ...]] = {}

    def turn_images(self, turn_id):
        return self.images.get(turn_id, ())


def test_four_turns_with_a_new_screenshot_each_stay_spliced_and_placed(fmt, reference):
    cache = ImageCache()
    lookup = ImageLookup()
    sizes = [(150, 100), (64, 64), (300, 120), (90, 210)]
    msgs: list[Message] = []
    tpl_msgs: list[dict] = []
    pils = []
    for k, (w, h) in enumerate(sizes):
        data, pil = _png(k, w, h)
        info = cache.decode(data, fmt.vision)
        msgs.append(Message.from_parts("user", [f"screen {k}:", info, "what now?"]))
        tpl_msgs.append({"role": "user", "content": [{"type": "text", "text": f"screen {k}:"}, {"type": "image"},
                                                      {"type": "text", "text": "what now?"}]})  # fmt: skip
        pils.append(pil)
        req = _req(msgs, session="s")
        p = plan(req, lookup, fmt)
        want_ids, grids = reference(tpl_msgs, pils)
        if k == 0:
            assert not p.spliced and p.prompt_ids.tolist() == want_ids  # the processor's own ids
        else:
            assert p.spliced and p.fork_reason is None
            # the spliced prompt is the full render with the history as sampled (same text here)
            assert p.prompt_ids.tolist() == want_ids
        assert [r.grid_thw for r in p.images] == grids and len(p.images) == k + 1
        for r, info in zip(p.images, (m.images[0] for m in msgs if m.role == "user")):
            assert r.hash == info.hash
            assert p.prompt_ids[r.offset - 1] == VISION_START_ID
            assert p.prompt_ids[r.offset : r.offset + r.length].tolist() == [IMAGE_PAD_ID] * r.length
            assert r.length == int(np.prod(r.grid_thw)) // 4  # merge size 2
        answer = f"Step {k}."
        out = fmt.tokenizer.encode(answer + "<|im_end|>", add_special_tokens=False)
        lookup.record(req, p, f"t{k}", Message("assistant", answer), out)
        lookup.images[f"t{k}"] = p.images
        msgs.append(Message("assistant", answer))
        tpl_msgs.append({"role": "assistant", "content": answer})
    assert cache.decodes == len(sizes)


def test_typed_placeholder_text_stays_text_and_is_not_an_image(fmt):
    data, _ = _png(7, 56, 56)
    info = ImageCache().decode(data, fmt.vision)
    req = _req([Message.from_parts("user", ["a literal <|image_pad|> and <|vision_start|>", info])])
    p = plan(req, ImageLookup(), fmt)
    assert len(p.images) == 1 and p.prompt_ids.tolist().count(VISION_START_ID) == 1
    assert p.prompt_ids.tolist().count(IMAGE_PAD_ID) == p.images[0].length


def test_a_template_that_drops_images_is_a_render_error(fmt, folder):
    tok = load_tokenizer(str(folder))
    plain = ChatFormat(tok, None, vision=fmt.vision)
    plain.template.render_ids = lambda *a, **k: [1, 2, 3]  # renders no placeholder at all
    data, _ = _png(1, 56, 56)
    req = _req([Message.from_parts("user", ["x", ImageCache().decode(data, fmt.vision)])])
    with pytest.raises(RenderError, match="0 image placeholders? .*for 1 images"):
        plan(req, ImageLookup(), plain)
