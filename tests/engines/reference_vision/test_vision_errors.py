"""Image requests the released servers cannot take are a clear 400 here (nothing is generated)."""

from __future__ import annotations

import base64

import pytest

from engines.reference.vision_files import IMAGE_PAD_ID, VISION_END_ID, VISION_START_ID
from tests.engines.reference_vision.helpers import data_url, post


@pytest.fixture(scope="module")
def prompt(oracle, images):
    text = oracle.chat_text([{"type": "image"}, {"type": "text", "text": "Hi"}])
    return oracle.collapsed_ids(text), oracle.expanded(text, images[:1])[0]


def sglang_error(url, ids, image_data) -> str:
    body = {"input_ids": ids, "image_data": image_data, "sampling_params": {"max_new_tokens": 2}}
    return post(url, "/generate", body, status=400)["error"]["message"]


def vllm_error(url, ids, urls) -> dict:
    body = {"token_ids": ids, "content_parts": [{"type": "image_url", "url": u} for u in urls], "sampling_params": {"max_tokens": 2}}
    return post(url, "/inference/v1/generate", body, status=400)["error"]


def test_pre_expanded_spans_are_refused_on_both_wires(vengine, prompt, images):
    _, expanded = prompt
    msg = sglang_error(vengine, expanded, [data_url(images[0])])
    assert "pre-expanded" in msg and "SGLang" in msg and "ONE <|image_pad|>" in msg
    err = vllm_error(vengine, expanded, [data_url(images[0])])
    assert "pre-expanded" in err["message"] and "vLLM" in err["message"]
    assert err["type"] == "BadRequestError" and err["code"] == 400


def test_placeholder_and_image_counts_must_match(vengine, prompt, images):
    ids, _ = prompt
    two = [data_url(b) for b in images]
    assert "1 image placeholder(s)" in sglang_error(vengine, ids, two) and "2 image(s)" in sglang_error(vengine, ids, two)
    no_pad = [t for t in ids if t != IMAGE_PAD_ID]
    assert "0 image placeholder(s)" in sglang_error(vengine, no_pad, two[:1])
    assert "0 image placeholder(s)" in vllm_error(vengine, no_pad, two[:1])["message"]
    # pads without images: the model would have nothing to put there
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}
    assert "no images were sent" in post(vengine, "/generate", body, status=400)["error"]["message"]
    body = {"model": "tiny-vl", "prompt": ids, "max_tokens": 1}
    assert "no images were sent" in post(vengine, "/v1/completions", body, status=400)["error"]["message"]


def test_placeholder_outside_vision_markers(vengine, prompt, images):
    ids, _ = prompt
    bare = [t for t in ids if t not in (VISION_START_ID, VISION_END_ID)]
    assert "not between <|vision_start|> and <|vision_end|>" in sglang_error(vengine, bare, [data_url(images[0])])


def test_bad_images(vengine, prompt):
    ids, _ = prompt
    assert "cannot decode image" in sglang_error(vengine, ids, ["data:image/png;base64," + base64.b64encode(b"not a png").decode()])
    assert "not valid base64" in sglang_error(vengine, ids, ["data:image/png;base64,@@@"])
    assert "data URLs only" in sglang_error(vengine, ids, ["https://example.com/cat.png"])
    assert "cannot decode image" in vllm_error(vengine, ids, ["data:image/png;base64," + base64.b64encode(b"GIF89a").decode()])["message"]


def test_engine_still_serves_after_errors(vengine, prompt, images):
    ids, expanded = prompt
    out = post(vengine, "/generate", {"input_ids": ids, "image_data": [data_url(images[0])], "sampling_params": {"max_new_tokens": 2}})
    assert out["meta_info"]["prompt_tokens"] == len(expanded) and len(out["output_ids"]) == 2


def test_model_checks_each_span_against_the_processor_count(vision_dir, images):
    """Backstop below the HTTP checks: spans that disagree with the processor's count are refused."""
    from engines.reference.models import load_language_model
    from engines.reference.vision import ImageInputError, ImageProcessor, ImageSpan

    lm = load_language_model(vision_dir)
    img = ImageProcessor(lm.vision).process(data_url(images[0]))
    ids = [VISION_START_ID] + [IMAGE_PAD_ID] * (img.n_tokens - 1) + [VISION_END_ID]
    with pytest.raises(ImageInputError, match="processor counts"):
        lm.prefill(ids, lm.new_cache(), keep_from=0, images=[ImageSpan(1, img.n_tokens - 1, img)])
    ids = [VISION_START_ID] + [IMAGE_PAD_ID] * img.n_tokens + [VISION_END_ID]
    lm.prefill(ids, lm.new_cache(), keep_from=0, images=[ImageSpan(1, img.n_tokens, img)])  # the right count passes
