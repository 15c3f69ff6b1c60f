"""vLLM's wire format in token space (docs/design.md section 9): the request bodies of
``/v1/completions`` and ``/inference/v1/generate`` and the parsing of their replies into a
``Segment``, as pure functions. ``engines.vllm`` (the client that sends them) re-exports every
name here."""

from __future__ import annotations

from typing import Any, Sequence

from engines.http import clean_logprobs, expect_dict, id_list, token_list, weight_version_spans
from engines.images import check_spans, collapse, data_url, stop_and_ban
from engines.types import EngineBadResponse, EngineImage, FinishReason, SamplingParams, Segment
from engines.vllm_worker import QUALNAME as EXTENSION_QUALNAME

_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}
_PATH = "/v1/completions"
GENERATE_PATH = "/inference/v1/generate"
SCALE_OUT_HINT = "start vLLM with --enable-scale-out (vLLM 0.32) so /inference/v1/generate, the token-in route that carries images, exists"
DEV_MODE_HINT = "start vLLM with VLLM_SERVER_DEV_MODE=1 (vLLM >= 0.19) for its pause / weight endpoints"
TIED_HEAD_WARNING = (
    "the model ties its LM head to the embeddings (tie_word_embeddings) and vLLM's in-place "
    "reload_weights does not refresh a tied head (on the CPU build its packed copy stays old): after "
    "a weight update vLLM would sample with the new body and the OLD head, so its logprobs are not "
    f"the published policy's. Start vLLM with --worker-extension-cls {EXTENSION_QUALNAME} (Splice's "
    "engines/vllm_worker.py importable there, e.g. PYTHONPATH=<splice checkout>), which re-ties "
    "the head after every update"
)


def completion_payload(
    input_ids: list[int], params: SamplingParams, *, model: str, echo: bool, stream: bool, encoded_ids: Any = None
) -> dict[str, Any]:
    """The ``/v1/completions`` body. ``max_tokens`` is always sent (vLLM's default is 16).
    ``encoded_ids``: ``input_ids`` as the body carries them, when already encoded (``IdsJson``)."""
    body: dict[str, Any] = {}
    if model:
        body["model"] = model
    body.update(
        {
            "prompt": token_list(input_ids) if encoded_ids is None else encoded_ids,
            "max_tokens": int(params.max_new_tokens),
            "temperature": float(params.temperature),
            "top_p": float(params.top_p),
            "top_k": int(params.top_k),
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
            "skip_special_tokens": False,
            "stream": bool(stream),
        }
    )
    if stream:
        body["stream_options"] = {"include_usage": True}
    if echo:
        body["echo"] = True
    body.update(stop_and_ban(params))
    return body


def generate_tokens_payload(
    input_ids: list[int],
    params: SamplingParams,
    images: Sequence[EngineImage],
    *,
    model: str,
    rid: str,
    prompt_logprobs: bool,
    stream: bool,
) -> dict[str, Any]:
    """The ``/inference/v1/generate`` body for a prompt with images.

    ``token_ids`` hold one ``<|image_pad|>`` per image (vLLM 0.32 always applies the Qwen-VL
    prompt update ``[pad] -> [pad] * N`` to token prompts; pre-expanded runs would keep their
    extra pads as text), ``content_parts`` the images in prompt order. ``sampling_params`` is
    vLLM's own ``SamplingParams`` (``max_tokens``, ``logprobs: 0`` = the sampled token's
    logprob, ``prompt_logprobs: 0`` only when owed). ``return_token_ids`` brings back the
    expanded prompt and its placeholder ranges, which Splice checks against its own spans.
    """
    check_spans(input_ids, images)
    sp: dict[str, Any] = {
        "max_tokens": int(params.max_new_tokens),
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": int(params.top_k),
        "logprobs": 0,
        "skip_special_tokens": False,
    }
    if prompt_logprobs:
        sp["prompt_logprobs"] = 0
    sp.update(stop_and_ban(params))
    body: dict[str, Any] = {}
    if model:
        body["model"] = model
    if rid:
        body["request_id"] = rid
    body.update(
        {
            "token_ids": [int(t) for t in collapse(input_ids, images)],
            "content_parts": [{"type": "image_url", "url": data_url(img)} for img in images],
            "sampling_params": sp,
            "return_token_ids": True,
            "stream": bool(stream),
        }
    )
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def check_placeholders(
    reply: dict, input_ids: list[int], images: Sequence[EngineImage], replica: str, *, length: int | None = None
) -> None:
    """vLLM expanded the collapsed prompt exactly as Splice did: same length and the same
    ``mm_placeholders`` ranges (present with ``return_token_ids``). A difference means the two
    image processors (min/max pixels, merge size) disagree."""
    got = reply.get("mm_placeholders")
    if isinstance(got, dict):
        ranges = [(int(r["offset"]), int(r["length"])) for r in got.get("image") or [] if isinstance(r, dict)]
        want = [(img.offset, img.length) for img in images]
        if ranges != want:
            raise EngineBadResponse(
                f"{replica}: the engine placed the images at {ranges}, Splice at {want} (offset, length); the "
                "engine's image processor settings (min_pixels / max_pixels / merge size) differ from the model "
                "folder Splice renders with",
                replica=replica,
                retryable=False,
            )
    if length is not None and length != len(input_ids):
        raise EngineBadResponse(
            f"{replica}: the engine expanded the {len(images)}-image prompt to {length} tokens, Splice to "
            f"{len(input_ids)}; the engine's image processor settings differ from Splice's",
            replica=replica,
            retryable=False,
        )


def _matched(fr: str, stop_reason: Any, ids: list[int]) -> int | str | None:
    if isinstance(stop_reason, (int, str)) and not isinstance(stop_reason, bool):
        return stop_reason
    if fr == "stop" and ids:
        return ids[-1]  # stop_reason null = the EOS token ended it
    return None


def prompt_logprob_values(raw: Any, input_ids: list[int], replica: str) -> list[float | None]:
    """``prompt_logprobs`` (one entry per expanded prompt position, the first null, each a map
    ``{"<id>": {"logprob", "rank", "decoded_token"}}`` holding at least the prompt's own id)
    as the prompt token's logprob per position."""
    if not isinstance(raw, list) or len(raw) != len(input_ids):
        n = len(raw) if isinstance(raw, list) else 0
        raise EngineBadResponse(f"{replica}: {n} prompt logprobs for a {len(input_ids)}-token prompt", replica=replica)
    values: list = []
    for j, entry in enumerate(raw):
        if entry is None:
            if j:
                raise EngineBadResponse(f"{replica}: no prompt logprob at position {j}", replica=replica)
            values.append(None)
            continue
        value = entry.get(str(input_ids[j])) if isinstance(entry, dict) else None
        if not isinstance(value, dict):
            raise EngineBadResponse(
                f"{replica}: prompt logprob {j} has no entry for token {input_ids[j]}", replica=replica
            )
        values.append(value.get("logprob"))
    out: list[float | None] = clean_logprobs(values)
    if raw and raw[0] is None:
        out[0] = None
    return out


def parse_generate(
    body: Any, input_ids: list[int], images: Sequence[EngineImage], *, prompt_logprobs: bool, replica: str
) -> Segment:
    """A ``/inference/v1/generate`` reply (``output_mode`` tokens) as a ``Segment``."""
    body = expect_dict(body, replica, GENERATE_PATH)
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise EngineBadResponse(f"{replica}: generate reply has no choices", replica=replica)
    usage = body.get("usage") or {}
    check_placeholders(body, input_ids, images, replica, length=usage.get("prompt_tokens"))
    choice = choices[0]
    ids = choice.get("token_ids") or []
    content = (choice.get("logprobs") or {}).get("content") or []
    if not isinstance(ids, list) or not isinstance(content, list) or len(content) != len(ids):
        raise EngineBadResponse(f"{replica}: token_ids and logprobs.content disagree", replica=replica)
    try:
        if [int(c["token_id"]) for c in content] != [int(t) for t in ids]:
            raise EngineBadResponse(f"{replica}: logprobs.content ids differ from token_ids", replica=replica)
    except (KeyError, TypeError, ValueError):
        raise EngineBadResponse(f"{replica}: malformed logprobs.content", replica=replica) from None
    fr = choice.get("finish_reason")
    if fr not in _FINISH:
        raise EngineBadResponse(f"{replica}: missing or unknown finish_reason {fr!r}", replica=replica)
    details = usage.get("prompt_tokens_details") or {}
    return Segment(
        output_ids=[int(t) for t in ids],
        logprobs=clean_logprobs([c.get("logprob") for c in content]),
        finish_reason=_FINISH[fr],
        matched_stop=_matched(fr, choice.get("stop_reason"), ids),
        input_logprobs=prompt_logprob_values(body.get("prompt_logprobs"), input_ids, replica) if prompt_logprobs else [],
        input_logprobs_start=0,
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        cached_tokens=int(details.get("cached_tokens") or 0),
        weight_version=None,
        weight_version_spans=weight_version_spans(choice.get("weight_versions")),
    )


def token_id(token: Any, replica: str) -> int:
    """``"token_id:123"`` -> 123 (what ``return_tokens_as_token_ids`` puts in ``logprobs.tokens``)."""
    if isinstance(token, str) and token.startswith("token_id:"):
        try:
            return int(token[9:])
        except ValueError:
            pass
    raise EngineBadResponse(f"{replica}: expected 'token_id:N', got {token!r}", replica=replica)


def parse_completion(body: Any, input_ids: list[int], *, echo: bool, replica: str) -> Segment:
    """``choices[0]`` of a completion reply as a ``Segment`` (prompt logprobs split off when echoed)."""
    body = expect_dict(body, replica, _PATH)
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise EngineBadResponse(f"{replica}: completion reply has no choices", replica=replica)
    choice = choices[0]
    lp = choice.get("logprobs") or {}
    tokens = lp.get("tokens") or []
    values = lp.get("token_logprobs") or []
    if not isinstance(tokens, list) or not isinstance(values, list) or len(tokens) != len(values):
        raise EngineBadResponse(f"{replica}: logprobs.tokens and token_logprobs disagree", replica=replica)
    ids = [token_id(t, replica) for t in tokens]
    n_prompt = len(input_ids)
    prompt_lps: list[float | None] = []
    if echo and len(ids) >= n_prompt:
        if ids[:n_prompt] != id_list(input_ids):
            raise EngineBadResponse(f"{replica}: echoed prompt differs from the prompt sent", replica=replica)
        prompt_lps = clean_logprobs(values[:n_prompt])
        if prompt_lps and values[0] is None:
            prompt_lps[0] = None
        ids, values = ids[n_prompt:], values[n_prompt:]
    elif echo and ids:  # partial echo: the reply is cut somewhere we cannot place
        raise EngineBadResponse(f"{replica}: echo returned {len(ids)} tokens for a {n_prompt}-token prompt", replica=replica)
    wire_ids = choice.get("token_ids")
    if isinstance(wire_ids, list) and wire_ids != ids:
        raise EngineBadResponse(f"{replica}: token_ids disagree with logprobs.tokens", replica=replica)
    fr = choice.get("finish_reason")
    if fr not in _FINISH:
        raise EngineBadResponse(f"{replica}: missing or unknown finish_reason {fr!r}", replica=replica)
    stop_reason = choice.get("stop_reason")
    if isinstance(stop_reason, (int, str)) and not isinstance(stop_reason, bool):
        matched: int | str | None = stop_reason
    elif fr == "stop" and ids:
        matched = ids[-1]  # stop_reason null = the EOS token ended it
    else:
        matched = None
    usage = body.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return Segment(
        output_ids=ids,
        logprobs=clean_logprobs(values),
        finish_reason=_FINISH[fr],
        matched_stop=matched,
        input_logprobs=prompt_lps,
        input_logprobs_start=0,
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        cached_tokens=int(details.get("cached_tokens") or 0),
        weight_version=None,
    )
