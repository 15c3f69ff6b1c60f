"""Prompts with images: Splice's render and splice bridge against the model's own processor.

The reference is transformers' ``Qwen2_5_VLProcessor`` expansion code (built without its
``__init__``, which needs torchvision) over ``Qwen2VLImageProcessorPil`` and the tokenizer's
``apply_chat_template``, on a model folder written by ``write_vision_processor_files``.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from PIL import Image
from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from engines.reference.vision_files import IMAGE_PAD_ID, VISION_END_ID, VISION_START_ID, write_vision_processor_files
from tokenization import ChatFormat, Message, Tool, ToolCall, load_tokenizer
from tokenization.conversation import fingerprint, message_images
from tokenization.vision import ImageError, VisionNotSupported, VisionSpec, decode_image, find_image_spans, image_spans

TOOLS = [Tool("click", "Click at a point", {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}})]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_vision_processor_files(tmp_path_factory.mktemp("vl"))


@pytest.fixture(scope="module")
def tok(folder):
    return load_tokenizer(str(folder))


@pytest.fixture(scope="module")
def spec(folder, tok):
    return VisionSpec.from_model_dir(folder, tok)


@pytest.fixture(scope="module", params=["generic", "qwen3"])
def cf(request, tok, spec):
    return ChatFormat(tok, None if request.param == "generic" else "qwen3", vision=spec)


@pytest.fixture(scope="module")
def processor(folder, tok):
    cfg = json.loads((folder / "preprocessor_config.json").read_text())
    p = Qwen2_5_VLProcessor.__new__(Qwen2_5_VLProcessor)
    p.image_processor = Qwen2VLImageProcessorPil(**{k: v for k, v in cfg.items() if k not in ("image_processor_type", "processor_class")})
    p.tokenizer = tok
    p.video_processor = None
    p.chat_template = tok.chat_template
    p.image_token, p.video_token = "<|image_pad|>", "<|video_pad|>"
    p.image_token_id, p.video_token_id = IMAGE_PAD_ID, 151656
    return p


def screenshot(width: int, height: int, seed: int) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr, "RGB").save(buf, format="PNG")
    return buf.getvalue()


def reference(processor, tok, msgs: list[dict], images: list[bytes], tools=None) -> tuple[list[int], list[list[int]]]:
    """``(input_ids, image_grid_thw)`` as the model's processor makes them for this conversation."""
    text = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    pil = [Image.open(io.BytesIO(b)) for b in images]
    out = processor(text=[text], images=pil or None, return_tensors="np")
    grids = out["image_grid_thw"].tolist() if images else []
    return out["input_ids"][0].tolist(), grids


def ref_message(m: Message) -> dict:
    """A ``Message`` as a client would hand it to ``apply_chat_template`` (parts as sent)."""
    d: dict = {"role": m.role}
    if m.parts:
        d["content"] = [{"type": "image"} if not isinstance(p, str) else {"type": "text", "text": p} for p in m.parts]
    else:
        d["content"] = m.content
    if m.tool_calls:
        d["tool_calls"] = [{"type": "function", "id": c.id, "function": {"name": c.name, "arguments": json.loads(c.arguments)}} for c in m.tool_calls]
    if m.tool_call_id:
        d["tool_call_id"] = m.tool_call_id
    return d


TEMPLATE_TOOLS = [{"type": "function", "function": t.template_spec()} for t in TOOLS]


@pytest.mark.parametrize("sizes", [[(100, 150)], [(1280, 800), (37, 501), (640, 480)]])
@pytest.mark.parametrize("with_tools", [False, True])
def test_first_turn_equals_the_processor(cf, tok, spec, processor, sizes, with_tools):
    data = [screenshot(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
    infos = [decode_image(d, spec) for d in data]
    parts: list = ["What is on the screen?"]
    for k, info in enumerate(infos):
        parts += [info, f"That was shot {k}."]
    msgs = [Message("system", "You operate a computer."), Message.from_parts("user", parts)]
    ids = cf.render(msgs, TOOLS if with_tools else None)
    ref_ids, grids = reference(processor, tok, [ref_message(m) for m in msgs], data, TEMPLATE_TOOLS if with_tools else None)
    assert ids == ref_ids
    assert [list(i.grid_thw) for i in infos] == grids
    spans = image_spans(ids, message_images(msgs), spec)
    for span, info, grid in zip(spans, infos, grids):
        assert span.length == grid[0] * grid[1] * grid[2] // 4  # merge size 2
        assert ids[span.offset - 1] == VISION_START_ID and ids[span.offset + span.length] == VISION_END_ID


def test_four_turns_with_a_new_screenshot_each_turn_stay_spliced(cf, tok, spec, processor):
    """Every turn: previous prompt + sampled ids + bridge == the processor's full render. Turns
    1-4 each add a screenshot (in a user message or a tool result); turn 5 adds text only."""
    shots = [screenshot(200 + 90 * k, 120 + 40 * k, seed=10 + k) for k in range(4)]
    infos = [decode_image(s, spec) for s in shots]
    history = [Message("system", "You operate a computer.")]
    new = [Message.from_parts("user", ["Open the settings.", infos[0]])]
    prompt: list[int] | None = None
    output: list[int] = []
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    for k in range(5):
        if prompt is None:
            history = history + new
            prompt = cf.render(history, TOOLS)
        else:
            res = cf.bridge(prompt, output, new, tools=TOOLS, history=history)
            assert res.ok, res.reason
            # the bridge expands only the new images: one span, the new screenshot's (none on turn 5)
            want = [(res.ids.index(IMAGE_PAD_ID), infos[k].n_tokens)] if k < 4 else []
            assert find_image_spans(res.ids, spec) == want
            history = history + new
            prompt = prompt + output + res.ids
        ref_ids, grids = reference(processor, tok, [ref_message(m) for m in history], shots[: k + 1], TEMPLATE_TOOLS)
        assert prompt == ref_ids, f"turn {k}"
        spans = image_spans(prompt, message_images(history), spec)
        assert [s.length for s in spans] == [g[0] * g[1] * g[2] // 4 for g in grids] == [i.n_tokens for i in infos[: k + 1]]
        assert [s.hash for s in spans] == [i.hash for i in infos[: k + 1]]
        # the model answers with a tool call; the tool's result carries the next screenshot
        call = ToolCall(f"call_{k}", "click", json.dumps({"x": 10 * k, "y": 5}))
        output = tok.encode(f'<tool_call>\n{{"name": "click", "arguments": {call.arguments}}}\n</tool_call>', add_special_tokens=False) + [im_end]
        history = history + [Message("assistant", "", tool_calls=(call,))]
        if k >= 3:
            new = [Message("tool", "clicked", tool_call_id=call.id), Message("user", "Anything else?")]
        elif k % 2 == 0:
            new = [Message.from_parts("tool", ["clicked", infos[k + 1]], tool_call_id=call.id)]
        else:
            new = [Message("tool", "clicked", tool_call_id=call.id), Message.from_parts("user", [infos[k + 1], "Now?"])]


def test_vision_tokens_are_control_tokens(cf, spec):
    from tokenization.vision import VISION_TOKENS

    assert {t: cf.control.ids[t] for t in VISION_TOKENS} == {
        "<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|vision_pad|>": 151654, "<|image_pad|>": 151655, "<|video_pad|>": 151656,
    }  # fmt: skip
    assert set(spec.banned_ids) == set(cf.control.ids[t] for t in VISION_TOKENS)


def test_text_spelling_vision_tokens_stays_text(cf, tok, spec, processor):
    literal = "type <|vision_start|><|image_pad|><|vision_end|> and <|image_pad|> here"
    shot = screenshot(100, 150, seed=3)
    info = decode_image(shot, spec)
    msgs = [Message.from_parts("user", [literal, info])]
    ids = cf.render(msgs)
    # the only vision tokens are the image's own span
    assert ids.count(VISION_START_ID) == 1 and ids.count(VISION_END_ID) == 1
    assert find_image_spans(ids, spec) == [(ids.index(VISION_START_ID) + 1, info.n_tokens)]
    user_text = tok.encode(literal, add_special_tokens=False, split_special_tokens=True)
    start = ids.index(tok.convert_tokens_to_ids("<|im_start|>")) + 3  # after "user\n"
    assert ids[start : start + len(user_text)] == user_text
    assert tok.decode(ids[start : start + len(user_text)]) == literal
    # The naive reference counts the user's text as image placeholders: it cannot even pair
    # the one image with its place.
    with pytest.raises(ValueError, match="number of images"):
        reference(processor, tok, [ref_message(m) for m in msgs], [shot])
    with pytest.raises(ValueError, match="no images were passed"):
        reference(processor, tok, [{"role": "user", "content": literal}], [])
    # The template's own tokenization turns the text into image placeholders; Splice does not.
    text_only = [Message("user", literal)]
    naive = list(tok.apply_chat_template([{"role": "user", "content": literal}], tokenize=True, add_generation_prompt=True, return_dict=False))
    assert IMAGE_PAD_ID in naive and VISION_START_ID in naive
    mine = cf.render(text_only)
    assert IMAGE_PAD_ID not in mine and VISION_START_ID not in mine
    assert mine != naive
    assert tok.decode(mine) == tok.decode(naive)  # same characters, different tokens


def test_bridge_keeps_text_spelling_vision_tokens_as_text(cf, tok, spec):
    info = decode_image(screenshot(64, 64, seed=4), spec)
    history = [Message.from_parts("user", ["hi", info])]
    prompt = cf.render(history)
    output = tok.encode("Hello.<|im_end|>", add_special_tokens=False)
    history.append(Message("assistant", "Hello."))
    new = [Message.from_parts("user", ["<|image_pad|> is a token; this is an image:", info])]
    res = cf.bridge(prompt, output, new, history=history)
    assert res.ok, res.reason
    assert find_image_spans(res.ids, spec) == [(res.ids.index(IMAGE_PAD_ID), info.n_tokens)]
    assert res.ids.count(VISION_START_ID) == 1


def test_fingerprint_includes_the_pixels(spec):
    a = decode_image(screenshot(50, 50, seed=1), spec)
    b = decode_image(screenshot(50, 50, seed=2), spec)
    same_a = decode_image(screenshot(50, 50, seed=1), spec)
    h = lambda img, text="look": fingerprint([Message("system", "s"), Message.from_parts("user", [text, img])])  # noqa: E731
    assert h(a) != h(b)
    assert h(a) == h(same_a)
    assert fingerprint([Message.from_parts("user", ["look", a])]) != fingerprint([Message.from_parts("user", [a, "look"])])
    assert fingerprint([Message.from_parts("user", ["look", a])]) != fingerprint([Message("user", "look")])
    # text-only messages keep the fingerprint they always had
    assert Message.from_parts("user", ["x", "y"]) == Message("user", "x\ny")


def test_text_only_model_refuses_images(qwen_tok, tok, spec):
    info = decode_image(screenshot(30, 30, seed=0), spec)
    msgs = [Message.from_parts("user", ["hi", info])]
    with pytest.raises(VisionNotSupported):
        ChatFormat(qwen_tok, "qwen3").render(msgs)
    text_model = ChatFormat(tok, None)
    with pytest.raises(VisionNotSupported):
        text_model.render(msgs)
    with pytest.raises(VisionNotSupported):
        text_model.bridge([1], [2], msgs, history=[Message("user", "a"), Message("assistant", "b")])
    assert issubclass(VisionNotSupported, ImageError)
