"""A vision-language model served by the reference engine: prompts with images expand as the
processor expands them, and every logprob equals a full float64 forward with the pixels."""

from __future__ import annotations

import pytest

from engines.reference.vision_files import IMAGE_PAD_ID, VISION_END_ID, VISION_START_ID
from tests.engines.reference_vision.helpers import assert_close, data_url, post


def one_image(oracle, images):
    text = oracle.chat_text([{"type": "image"}, {"type": "text", "text": "What is shown?"}])
    return text, images[:1]


def two_images(oracle, images):
    text = oracle.chat_text(
        [{"type": "text", "text": "First"}, {"type": "image"}, {"type": "text", "text": "then"}, {"type": "image"}, {"type": "text", "text": "compare."}]
    )
    return text, images


PROMPTS = {"one": one_image, "two": two_images}


@pytest.mark.parametrize("which", ["one", "two"])
def test_sglang_expansion_and_logprobs_equal_a_forward_with_pixels(vengine, oracle, images, which):
    text, imgs = PROMPTS[which](oracle, images)
    collapsed = oracle.collapsed_ids(text)
    assert collapsed.count(IMAGE_PAD_ID) == len(imgs)
    want_ids, grids = oracle.expanded(text, imgs)
    body = {
        "input_ids": collapsed,
        "image_data": [data_url(b) for b in imgs],
        "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 3, "ignore_eos": True},
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    out = post(vengine, "/generate", body)
    meta = out["meta_info"]
    # expanded coordinates: the processor's own ids, one entry per expanded prompt position
    assert meta["prompt_tokens"] == len(want_ids) == len(collapsed) + sum(g[0] * g[1] * g[2] // 4 - 1 for g in grids)
    # SGLang reports the ids of image positions as 0 (they hold hash sentinels there)
    assert [e[1] for e in meta["input_token_logprobs"]] == [0 if t == IMAGE_PAD_ID else t for t in want_ids]
    ids = out["output_ids"]
    assert len(ids) == 8
    want = oracle.logprobs(want_ids + ids, imgs)
    assert_close([e[0] for e in meta["output_token_logprobs"]], want[len(want_ids) :], "output")
    assert_close([e[0] for e in meta["input_token_logprobs"]], want[: len(want_ids)], "input")
    # the images matter: the same ids without pixels (pads as plain tokens) score differently
    plain = oracle.logprobs(want_ids + ids, [])
    assert max(abs(a - b) for a, b in zip(plain[len(want_ids) :], want[len(want_ids) :])) > 1e-2


@pytest.mark.parametrize("where", ["inside_first_image", "after_images"])
def test_input_logprobs_from_a_start_inside_the_prompt(vengine, oracle, images, where):
    text, imgs = two_images(oracle, images)
    want_ids, _ = oracle.expanded(text, imgs)
    first_pad = want_ids.index(IMAGE_PAD_ID)
    start = first_pad + 5 if where == "inside_first_image" else len(want_ids) - 4
    body = {
        "input_ids": oracle.collapsed_ids(text),
        "image_data": [data_url(b) for b in imgs],
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": start,
    }
    meta = post(vengine, "/generate", body)["meta_info"]
    entries = meta["input_token_logprobs"]
    assert len(entries) == len(want_ids) - start and entries[0][0] is None
    assert [e[1] for e in entries] == [0 if t == IMAGE_PAD_ID else t for t in want_ids[start:]]
    assert_close([e[0] for e in entries[1:]], oracle.logprobs(want_ids, imgs)[start + 1 :], f"input from {start}")


def test_vllm_generate_with_content_parts(vengine, oracle, images):
    text, imgs = two_images(oracle, images)
    want_ids, grids = oracle.expanded(text, imgs)
    body = {
        "request_id": "vl-1",
        "token_ids": oracle.collapsed_ids(text),
        "content_parts": [{"type": "image_url", "url": data_url(b)} for b in imgs],
        "sampling_params": {"max_tokens": 6, "temperature": 0.8, "seed": 5, "logprobs": 1, "prompt_logprobs": 0, "ignore_eos": True},
        "return_token_ids": True,
    }
    out = post(vengine, "/inference/v1/generate", body)
    assert out["request_id"] == "generate-tokens-vl-1" and out["output_mode"] == "tokens"
    assert out["prompt_token_ids"] == want_ids
    pads = [i for i, t in enumerate(want_ids) if t == IMAGE_PAD_ID]
    spans = out["mm_placeholders"]["image"]
    assert [s["length"] for s in spans] == [g[0] * g[1] * g[2] // 4 for g in grids]
    assert spans[0]["offset"] == pads[0] and want_ids[spans[0]["offset"] - 1] == VISION_START_ID
    assert want_ids[spans[1]["offset"] + spans[1]["length"]] == VISION_END_ID
    assert out["usage"]["prompt_tokens"] == len(want_ids)
    choice = out["choices"][0]
    ids = choice["token_ids"]
    assert len(ids) == 6 and choice["finish_reason"] == "length" and choice["weight_versions"] == [{"version": "0", "start": 0, "end": 6}]
    want = oracle.logprobs(want_ids + ids, imgs)  # vLLM: raw logprobs, not temperature-scaled
    content = choice["logprobs"]["content"]
    assert [c["token_id"] for c in content] == ids
    assert_close([c["logprob"] for c in content], want[len(want_ids) :], "vllm output")
    assert all(c["top_logprobs"] and c["top_logprobs"][0]["token_id"] == c["token_id"] for c in content)
    prompt_lps = out["prompt_logprobs"]
    assert prompt_lps[0] is None and len(prompt_lps) == len(want_ids)
    got = [None] + [prompt_lps[i][str(want_ids[i])]["logprob"] for i in range(1, len(want_ids))]
    assert_close(got, want[: len(want_ids)], "vllm prompt")


def test_the_same_image_is_processed_once(vision_dir, images, oracle):
    """Re-sent images (same bytes, or the same pixels re-encoded) hit the per-hash cache."""
    import io

    from PIL import Image

    from engines.reference.models import load_language_model
    from engines.reference.vision import ImageProcessor

    proc = ImageProcessor(load_language_model(vision_dir).vision)
    a = proc.process(data_url(images[0]))
    b = proc.process(data_url(images[0]))
    buf = io.BytesIO()
    Image.open(io.BytesIO(images[0])).save(buf, "BMP")  # same pixels, different encoding
    c = proc.process(data_url(buf.getvalue(), "image/bmp"))
    assert a is b is c and proc.processed == 1
    d = proc.process(data_url(images[1]))
    assert d.hash != a.hash and proc.processed == 2
    want = oracle.image_processor(images=[Image.open(io.BytesIO(images[0])).convert("RGB")], return_tensors="pt")
    assert tuple(want["image_grid_thw"][0].tolist()) == a.grid_thw and a.n_tokens == 20
    assert (want["pixel_values"] == a.pixel_values).all()


def test_vllm_generate_stream_matches_the_full_response(vengine, oracle, images):
    import httpx
    import orjson

    text, imgs = one_image(oracle, images)
    body = {
        "token_ids": oracle.collapsed_ids(text),
        "content_parts": [{"type": "image_url", "url": data_url(imgs[0])}],
        "sampling_params": {"max_tokens": 5, "temperature": 0, "logprobs": 0, "ignore_eos": True},
        "return_token_ids": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    full = post(vengine, "/inference/v1/generate", {**body, "stream": False})
    with httpx.stream("POST", vengine + "/inference/v1/generate", json=body, timeout=60) as r:
        assert r.status_code == 200
        frames = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    chunks = [orjson.loads(f) for f in frames[:-1]]
    assert chunks[0]["prompt_token_ids"] == full["prompt_token_ids"]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert sum((c["token_ids"] for c in choices), []) == full["choices"][0]["token_ids"]
    assert [x["logprob"] for c in choices for x in c["logprobs"]["content"]] == [x["logprob"] for x in full["choices"][0]["logprobs"]["content"]]
    assert choices[-1]["finish_reason"] == "length" and chunks[-1]["usage"]["completion_tokens"] == 5


def test_text_only_prompt_on_the_vision_model(vengine, oracle):
    ids = oracle.collapsed_ids(oracle.chat_text([{"type": "text", "text": "No picture today."}]))
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 6, "sampling_seed": 4, "ignore_eos": True}, "return_logprob": True, "logprob_start_len": 2}
    out = post(vengine, "/generate", body)
    want = oracle.logprobs(ids + out["output_ids"], [])
    assert_close([e[0] for e in out["meta_info"]["output_token_logprobs"]], want[len(ids) :], "text-only output")
    assert_close([e[0] for e in out["meta_info"]["input_token_logprobs"][1:]], want[3 : len(ids)], "text-only input")


def test_interleaved_requests_keep_their_own_mrope_offsets(vengine, oracle, images):
    """Two requests with different images (different M-RoPE offsets) decode at the same time."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [one_image(oracle, images), two_images(oracle, images)]

    def run(i):
        text, imgs = prompts[i]
        body = {"input_ids": oracle.collapsed_ids(text), "image_data": [data_url(b) for b in imgs], "return_logprob": True,
                "sampling_params": {"max_new_tokens": 15, "sampling_seed": 7 + i, "ignore_eos": True}}
        return post(vengine, "/generate", body)

    with ThreadPoolExecutor(2) as ex:
        outs = list(ex.map(run, range(2)))
    for (text, imgs), out in zip(prompts, outs):
        expanded, _ = oracle.expanded(text, imgs)
        want = oracle.logprobs(expanded + out["output_ids"], imgs)
        assert_close([e[0] for e in out["meta_info"]["output_token_logprobs"]], want[len(expanded) :], "interleaved")


def test_sglang_text_input_with_images_and_streaming(vengine, oracle, images):
    import httpx
    import orjson

    text, imgs = one_image(oracle, images)
    expanded, _ = oracle.expanded(text, imgs)
    body = {"text": text, "image_data": data_url(imgs[0]), "return_logprob": True, "stream": True,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}
    with httpx.stream("POST", vengine + "/generate", json=body, timeout=60) as r:
        assert r.status_code == 200
        frames = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    last = orjson.loads(frames[-2])
    assert last["meta_info"]["prompt_tokens"] == len(expanded) and len(last["output_ids"]) == 4
    want = oracle.logprobs(expanded + last["output_ids"], imgs)
    assert_close([e[0] for e in last["meta_info"]["output_token_logprobs"]], want[len(expanded) :], "streamed")
