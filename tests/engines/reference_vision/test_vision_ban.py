"""``logit_bias`` bans tokens at sampling: SGLang reports logprobs of the biased logits (its
sampler's processed logprobs), vLLM reports raw ones (its default ``logprobs_mode``)."""

from __future__ import annotations

from engines.reference.vision_files import IMAGE_PAD_ID, VIDEO_PAD_ID, VISION_END_ID, VISION_PAD_ID, VISION_START_ID
from tests.engines.reference_vision.helpers import assert_close, data_url, post

VISION_IDS = [VISION_START_ID, VISION_END_ID, VISION_PAD_ID, IMAGE_PAD_ID, VIDEO_PAD_ID]


def prompt(oracle, images):
    text = oracle.chat_text([{"type": "image"}, {"type": "text", "text": "Describe it."}])
    return oracle.collapsed_ids(text), oracle.expanded(text, images[:1])[0], images[:1]


def sglang(url, ids, imgs, sp):
    body = {"input_ids": ids, "image_data": [data_url(b) for b in imgs], "sampling_params": sp, "return_logprob": True}
    return post(url, "/generate", body)


def test_sglang_banned_ids_never_sampled_and_logprobs_are_biased(vengine, oracle, images):
    ids, expanded, imgs = prompt(oracle, images)
    free = sglang(vengine, ids, imgs, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})["output_ids"]
    bias = {t: -100.0 for t in set(free) | set(VISION_IDS)}  # ban what the model would pick
    wire = {str(t): b for t, b in bias.items()}
    greedy = sglang(vengine, ids, imgs, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True, "logit_bias": wire})
    out = greedy["output_ids"]
    assert len(out) == 8 and not set(out) & set(bias)
    want = oracle.logprobs(expanded + out, imgs, bias)
    assert_close([e[0] for e in greedy["meta_info"]["output_token_logprobs"]], want[len(expanded) :], "biased greedy")
    sampled = sglang(vengine, ids, imgs, {"max_new_tokens": 12, "sampling_seed": 11, "ignore_eos": True, "logit_bias": wire})
    out = sampled["output_ids"]
    assert not set(out) & set(bias)
    want = oracle.logprobs(expanded + out, imgs, bias)
    assert_close([e[0] for e in sampled["meta_info"]["output_token_logprobs"]], want[len(expanded) :], "biased sampled")
    # the raw values differ, so the comparison above does tell biased from raw logprobs
    raw = oracle.logprobs(expanded + out, imgs)
    assert max(abs(a - b) for a, b in zip(raw[len(expanded) :], want[len(expanded) :])) > 1e-3


def test_sglang_positive_bias_forces_a_token(vengine, oracle, images):
    ids, expanded, imgs = prompt(oracle, images)
    forced = 1000
    out = sglang(vengine, ids, imgs, {"max_new_tokens": 4, "sampling_seed": 2, "ignore_eos": True, "logit_bias": {str(forced): 100.0}})
    assert out["output_ids"] == [forced] * 4
    want = oracle.logprobs(expanded + [forced] * 4, imgs, {forced: 100.0})
    assert_close([e[0] for e in out["meta_info"]["output_token_logprobs"]], want[len(expanded) :], "forced")


def test_vllm_logit_bias_bans_and_logprobs_stay_raw(vengine, oracle, images):
    ids, expanded, imgs = prompt(oracle, images)
    parts = [{"type": "image_url", "url": data_url(b)} for b in imgs]

    def gen(sp):
        body = {"token_ids": ids, "content_parts": parts, "sampling_params": {"logprobs": 0, "ignore_eos": True, **sp}}
        return post(vengine, "/inference/v1/generate", body)["choices"][0]

    free = gen({"max_tokens": 6, "temperature": 0})["token_ids"]
    bias = {t: -100.0 for t in set(free) | set(VISION_IDS)}
    choice = gen({"max_tokens": 6, "temperature": 0, "logit_bias": {str(t): b for t, b in bias.items()}})
    out = choice["token_ids"]
    assert len(out) == 6 and not set(out) & set(bias)
    # greedy under the bias = argmax of the biased logits ...
    biased = oracle.logprobs(expanded + out, imgs, bias)
    logits = oracle.logits(expanded + out, imgs)
    for j, t in enumerate(out):
        row = logits[len(expanded) - 1 + j].clone()
        for b in bias:
            row[b] -= 100.0
        assert int(row.argmax()) == t
    # ... while the reported logprobs are the raw ones (vLLM's default raw_logprobs mode)
    raw = oracle.logprobs(expanded + out, imgs)
    assert_close([c["logprob"] for c in choice["logprobs"]["content"]], raw[len(expanded) :], "vllm raw")
    assert max(abs(a - b) for a, b in zip(raw[len(expanded) :], biased[len(expanded) :])) > 1e-3


def test_out_of_vocab_bias_is_a_400(vengine, oracle, images):
    ids, _, imgs = prompt(oracle, images)
    body = {"input_ids": ids, "image_data": [data_url(b) for b in imgs], "sampling_params": {"logit_bias": {"999999": -100.0}}}
    err = post(vengine, "/generate", body, status=400)["error"]["message"]
    assert "logit_bias must has keys in [0, 151935]" in err
    body = {"token_ids": ids, "content_parts": [{"type": "image_url", "url": data_url(imgs[0])}], "sampling_params": {"logit_bias": {"-3": 1.0}}}
    assert "logit_bias" in post(vengine, "/inference/v1/generate", body, status=400)["error"]["message"]
