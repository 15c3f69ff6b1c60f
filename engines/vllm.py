"""Async client for vLLM's OpenAI ``/v1/completions`` endpoint in token space (docs/design.md section 9).

The prompt goes in as ids; ids come back as ``"token_id:N"`` strings (and ``token_ids``), so
nothing is ever decoded and re-encoded. ``echo`` is only sent when prompt logprobs are owed,
because it disables prefix-cache reads. vLLM clamps ``-inf`` to ``-9999.0``; Splice keeps that
value (``engines.http.NEG_INF_LOGPROB``) for every engine.

Control goes through vLLM's development endpoints (``VLLM_SERVER_DEV_MODE=1``, vLLM 0.19+;
wire shapes from vLLM 0.32's ``entrypoints/rl/online/api_router.py`` and
``entrypoints/serve/dev/rpc/api_router.py``):

- ``POST /pause?mode=abort`` / ``POST /resume``;
- ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": PATH}}`` loads
  weights from disk in place (``{"results": [null, ...]}``, one entry per worker);
- ``POST /update_weight_version {"new_version": "7"}`` and ``GET /weight_info``
  (``{"weight_version": "7"}``; ``"default"`` before any update).

Without dev mode those routes do not exist (HTTP 404): ``info()`` says so at start-up, and the
calls raise ``EngineUnsupported`` naming the missing setting.

Prompts with images go to ``POST /inference/v1/generate`` (vLLM 0.32's token-in / token-out
route, ``entrypoints/scale_out/token_in_token_out/``; mounted by ``vllm serve
--enable-scale-out``, HTTP 403 otherwise) with each image span collapsed to one pad and the
images as ``content_parts`` (docs/engines.md, "Images"). Text-only prompts stay on
``/v1/completions``. vLLM 0.32's ``reload_weights`` leaves an LM head tied to the embeddings
(``tie_word_embeddings``) stale on its CPU build; when vLLM runs Splice's worker extension
(``engines/vllm_worker.py``, seen in ``/server_info``) weights load through it and the head is
re-tied, otherwise ``info()`` warns. A reload that fails inside vLLM's worker kills its
EngineCore (see docs/engines.md).
"""

from __future__ import annotations

from typing import Any, Sequence

import httpx

import logging
import os

from engines.client import TokensCallback, config_ties_head, model_card, positive_int, prefill_values
from engines.http import Http, clean_logprob, deadline, expect_dict, weight_version_spans
from engines.images import check_spans, collapse, data_url, stop_and_ban
from engines.resume import parse_version
from engines.weight_transfer import TensorBatch, WeightGroup, vllm_finish_body, vllm_init_body, vllm_update_body
from engines.sglang import ROUTING_HEADER, routing_value
from engines.vllm_worker import QUALNAME as EXTENSION_QUALNAME
from engines.vllm_worker import REFRESH_METHOD, RELOAD_METHOD
from engines.types import (
    EngineBadResponse,
    EngineError,
    EngineImage,
    EngineInfo,
    EngineRejected,
    EngineUnsupported,
    FinishReason,
    SamplingParams,
    Segment,
)

log = logging.getLogger(__name__)

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
    input_ids: list[int], params: SamplingParams, *, model: str, echo: bool, stream: bool
) -> dict[str, Any]:
    """The ``/v1/completions`` body. ``max_tokens`` is always sent (vLLM's default is 16)."""
    body: dict[str, Any] = {}
    if model:
        body["model"] = model
    body.update(
        {
            "prompt": [int(t) for t in input_ids],
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
    out: list[float | None] = []
    for j, entry in enumerate(raw):
        if entry is None:
            if j:
                raise EngineBadResponse(f"{replica}: no prompt logprob at position {j}", replica=replica)
            out.append(None)
            continue
        value = entry.get(str(input_ids[j])) if isinstance(entry, dict) else None
        if not isinstance(value, dict):
            raise EngineBadResponse(
                f"{replica}: prompt logprob {j} has no entry for token {input_ids[j]}", replica=replica
            )
        out.append(clean_logprob(value.get("logprob")))
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
        logprobs=[clean_logprob(c.get("logprob")) for c in content],
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
        if ids[:n_prompt] != list(input_ids):
            raise EngineBadResponse(f"{replica}: echoed prompt differs from the prompt sent", replica=replica)
        prompt_lps = [None if (j == 0 and v is None) else clean_logprob(v) for j, v in enumerate(values[:n_prompt])]
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
        logprobs=[clean_logprob(v) for v in values],
        finish_reason=_FINISH[fr],
        matched_stop=matched,
        input_logprobs=prompt_lps,
        input_logprobs_start=0,
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        cached_tokens=int(details.get("cached_tokens") or 0),
        weight_version=None,
    )


class VLLMClient:
    """One vLLM replica (OpenAI-compatible server, 0.10.2+; pause/resume need 0.19+ dev mode)."""

    kind = "vllm"

    def __init__(
        self,
        client: httpx.AsyncClient,
        url: str,
        *,
        model: str = "",
        timeout_s: float = 600.0,
        admin_timeout_s: float = 60.0,
    ):
        self.http = Http(client, url)
        self.url = self.http.url
        self.model = model
        self.timeout_s = timeout_s
        self.admin_timeout_s = admin_timeout_s
        #: vLLM runs Splice's worker extension (set by ``info()``): weight loads go through it.
        self.extension = False

    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        *,
        rid: str,
        input_logprobs_from: int | None = None,
        on_tokens: TokensCallback | None = None,
        routing_key: str | None = None,
        images: Sequence[EngineImage] = (),
    ) -> Segment:
        """One completion call. ``rid`` is unused (closing the connection aborts a request on
        vLLM); ``routing_key`` goes out as ``X-SMG-Routing-Key`` for a router (smg) in front.
        With ``images`` the call goes to ``/inference/v1/generate`` instead."""
        echo = input_logprobs_from is not None
        headers = {ROUTING_HEADER: routing_value(routing_key)} if routing_key else None
        if images:
            return await self._generate_images(input_ids, params, images, rid, echo, on_tokens, headers)
        payload = completion_payload(input_ids, params, model=self.model, echo=echo, stream=on_tokens is not None)
        if on_tokens is None:
            body = await self.http.request("POST", _PATH, body=payload, timeout=self.timeout_s, headers=headers)
            return parse_completion(body, input_ids, echo=echo, replica=self.url)
        async with deadline(self.timeout_s, self.url, _PATH):  # total, not per read
            return await self._stream(payload, input_ids, echo, on_tokens, headers)

    async def _stream(
        self, payload: dict, input_ids: list[int], echo: bool, on_tokens: TokensCallback, headers: dict[str, str] | None = None
    ) -> Segment:
        """Collect OpenAI completion chunks; with echo the first chunk carries the prompt first."""
        tokens: list[str] = []
        values: list[Any] = []
        token_ids: list[int] = []
        saw_token_ids = False
        finish: str | None = None
        stop_reason: Any = None
        usage: dict | None = None
        skip = len(input_ids) if echo else 0
        emitted = 0
        async with self.http.stream(_PATH, payload, timeout=self.timeout_s, headers=headers) as resp:
            async for chunk in self.http.sse(resp, _PATH):
                if isinstance(chunk.get("usage"), dict):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or []:
                    lp = choice.get("logprobs") or {}
                    tokens.extend(lp.get("tokens") or [])
                    values.extend(lp.get("token_logprobs") or [])
                    if isinstance(choice.get("token_ids"), list):
                        saw_token_ids = True
                        token_ids.extend(choice["token_ids"])
                    if choice.get("finish_reason") is not None:
                        finish, stop_reason = choice["finish_reason"], choice.get("stop_reason")
                if len(tokens) - skip > emitted and len(tokens) == len(values):
                    new = tokens[skip + emitted :]
                    await on_tokens(
                        [token_id(t, self.url) for t in new], [clean_logprob(v) for v in values[skip + emitted :]]
                    )
                    emitted += len(new)
        final = {
            "choices": [
                {
                    "logprobs": {"tokens": tokens, "token_logprobs": values},
                    "token_ids": token_ids if saw_token_ids else None,
                    "finish_reason": finish,
                    "stop_reason": stop_reason,
                }
            ],
            "usage": usage,
        }
        return parse_completion(final, input_ids, echo=echo, replica=self.url)

    async def _generate_images(
        self,
        input_ids: list[int],
        params: SamplingParams,
        images: Sequence[EngineImage],
        rid: str,
        prompt_logprobs: bool,
        on_tokens: TokensCallback | None,
        headers: dict[str, str] | None,
    ) -> Segment:
        """``/inference/v1/generate``. Its stream schema has no prompt logprobs, so a call that
        owes them runs unstreamed and hands its tokens on in one piece."""
        stream = on_tokens is not None and not prompt_logprobs
        payload = generate_tokens_payload(
            input_ids, params, images, model=self.model, rid=rid, prompt_logprobs=prompt_logprobs, stream=stream
        )
        try:
            if not stream:
                body = await self.http.request("POST", GENERATE_PATH, body=payload, timeout=self.timeout_s, headers=headers)
                seg = parse_generate(body, input_ids, images, prompt_logprobs=prompt_logprobs, replica=self.url)
                if on_tokens is not None and seg.output_ids:
                    await on_tokens(list(seg.output_ids), list(seg.logprobs))
                return seg
            async with deadline(self.timeout_s, self.url, GENERATE_PATH):
                return await self._stream_generate(payload, input_ids, images, on_tokens, headers)
        except EngineRejected as exc:
            if " HTTP 403:" in str(exc) and "scale-out" in str(exc).lower():
                raise EngineUnsupported(f"{self.url}{GENERATE_PATH} is disabled: {SCALE_OUT_HINT}", replica=self.url) from exc
            if " HTTP 404:" in str(exc):
                raise EngineUnsupported(f"{self.url}{GENERATE_PATH} does not exist: {SCALE_OUT_HINT}", replica=self.url) from exc
            raise

    async def _stream_generate(
        self,
        payload: dict,
        input_ids: list[int],
        images: Sequence[EngineImage],
        on_tokens: TokensCallback,
        headers: dict[str, str] | None,
    ) -> Segment:
        """Collect ``/inference/v1/generate`` SSE chunks: token deltas per chunk, the expanded
        prompt's placeholders on the first, ``weight_versions`` on the last choice chunk, usage
        in a final chunk without choices."""
        ids: list[int] = []
        content: list[dict] = []
        finish: str | None = None
        stop_reason: Any = None
        spans: Any = None
        usage: dict = {}
        async with self.http.stream(GENERATE_PATH, payload, timeout=self.timeout_s, headers=headers) as resp:
            async for chunk in self.http.sse(resp, GENERATE_PATH):
                if "mm_placeholders" in chunk:
                    check_placeholders(chunk, input_ids, images, self.url)  # before any token is passed on
                if isinstance(chunk.get("usage"), dict):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or []:
                    new = [int(t) for t in choice.get("token_ids") or []]
                    lps = (choice.get("logprobs") or {}).get("content") or []
                    if len(lps) != len(new):
                        raise EngineBadResponse(f"{self.url}: stream chunk token_ids and logprobs disagree", replica=self.url)
                    ids.extend(new)
                    content.extend(lps)
                    if choice.get("weight_versions") is not None:
                        spans = choice["weight_versions"]
                    if choice.get("finish_reason") is not None:
                        finish, stop_reason = choice["finish_reason"], choice.get("stop_reason")
                    if new:
                        await on_tokens(new, [clean_logprob(c.get("logprob")) for c in lps])
        final = {
            "choices": [
                {
                    "token_ids": ids,
                    "logprobs": {"content": content},
                    "finish_reason": finish,
                    "stop_reason": stop_reason,
                    "weight_versions": spans,
                }
            ],
            "usage": usage,
        }
        return parse_generate(final, input_ids, images, prompt_logprobs=False, replica=self.url)

    async def prefill(
        self,
        input_ids: list[int],
        start: int,
        *,
        routing_key: str | None = None,
        images: Sequence[EngineImage] = (),
    ) -> tuple[list[float], str | None]:
        """A prompt-logprobs call: ``max_tokens: 1``, ``echo: true`` (``prompt_logprobs: 0``
        with images); the sampled token is dropped."""
        if not 1 <= start <= len(input_ids):
            raise ValueError(f"prefill start must be in [1, {len(input_ids)}], got {start}")
        seg = await self.generate(
            input_ids, SamplingParams(max_new_tokens=1), rid="", input_logprobs_from=start, routing_key=routing_key, images=images
        )
        return prefill_values(seg, input_ids, start, self.url), None

    async def _dev(self, method: str, path: str, body: dict | None = None, *, timeout: float | None = None):
        """A dev-mode call; a missing route (HTTP 404) becomes ``EngineUnsupported``."""
        try:
            return await self.http.request(method, path, body=body, timeout=timeout or self.admin_timeout_s, allow_empty=True)
        except EngineRejected as exc:
            if " HTTP 404:" in str(exc):
                raise EngineUnsupported(f"{self.url}{path} does not exist: {DEV_MODE_HINT}", replica=self.url) from exc
            raise

    async def pause(self) -> None:
        await self._dev("POST", "/pause?mode=abort")

    async def resume(self) -> None:
        await self._dev("POST", "/resume")

    async def update_weights(self, model_path: str, version: int) -> None:
        """Reload weights in place from ``model_path`` (a path on the engine's filesystem, sent
        untouched), then set and read back the weight version.

        The engine's answer decides: an error reply from ``reload_weights`` (bad path, shape
        mismatch) raises and the version is not touched; a version that does not read back
        raises ``EngineBadResponse``.
        """
        method = RELOAD_METHOD if self.extension else "reload_weights"
        body = {"method": method, "kwargs": {"weights_path": str(model_path)}}
        try:
            reply = await self._dev("POST", "/collective_rpc", body, timeout=self.timeout_s)
        except EngineUnsupported:
            raise
        except EngineError as exc:
            # vLLM 0.32: a reload that fails inside the worker (bad path, wrong shapes) kills the
            # EngineCore; say so, so the operator restarts the engine rather than retrying.
            if not await self.health():
                exc.args = (f"{exc.args[0]}; the engine is no longer healthy (a failed vLLM reload_weights kills its EngineCore: restart it)",)
            exc.retryable = False
            raise
        if isinstance(reply, dict) and isinstance(reply.get("results"), list):
            errors = [r for r in reply["results"] if isinstance(r, dict) and r.get("error")]
            if errors:
                raise EngineRejected(f"{self.url}: {method}({model_path!r}) failed: {errors[0]['error']}", replica=self.url)
        await self._dev("POST", "/update_weight_version", {"new_version": str(int(version))})
        now = await self.weight_version()
        if parse_version(now) != int(version):
            raise EngineBadResponse(
                f"{self.url}: weight version reads back as {now!r} after setting {version}", replica=self.url, retryable=False
            )

    # -- weights over torch.distributed (docs/engines.md) ----------------------------------------

    async def weight_ranks(self) -> int:
        """``GET /get_world_size`` (dev mode): every worker (TP x PP x DP) joins the group."""
        body = await self._dev("GET", "/get_world_size?include_dp=true")
        return positive_int((body or {}).get("world_size")) or 1

    async def init_weights_group(self, group: WeightGroup) -> None:
        """``/init_weight_transfer_engine`` (dev mode, ``--weight-transfer-config
        '{"backend": "nccl"}'``). vLLM's transfer engines are NCCL only, and a server holds one
        (``group_name`` is Splice's, not vLLM's)."""
        if group.backend != "nccl":
            raise EngineUnsupported(f"{self.url}: vLLM's weight transfer runs over NCCL only, not {group.backend!r}", replica=self.url)
        await self._dev("POST", "/init_weight_transfer_engine", vllm_init_body(group), timeout=self.timeout_s)

    async def update_weights_from_distributed(self, batch: TensorBatch) -> None:
        """``/start_weight_update`` before the first bucket, ``/update_weights`` for each,
        ``/finish_weight_update`` with the version after the last."""
        if batch.first:
            await self._dev("POST", "/start_weight_update", None, timeout=self.timeout_s)
        await self._dev("POST", "/update_weights", vllm_update_body(batch), timeout=self.timeout_s)
        if batch.final:
            await self._dev("POST", "/finish_weight_update", vllm_finish_body(batch), timeout=self.timeout_s)
            if self.extension:  # the transfer bypasses reload_weights: rebuild tied layers' derived copies
                await self._dev("POST", "/collective_rpc", {"method": REFRESH_METHOD}, timeout=self.timeout_s)

    async def destroy_weights_group(self, group_name: str) -> None:
        await self._dev("POST", "/shutdown_weight_transfer_engine", None, timeout=self.timeout_s)

    async def set_weight_version(self, version: int) -> None:
        """``POST /update_weight_version`` (dev mode), so ``/weight_info`` stamps the right version
        after a trainer moved the weights itself; a server without dev mode keeps none."""
        try:
            await self._dev("POST", "/update_weight_version", {"new_version": str(int(version))})
        except EngineUnsupported:
            pass

    async def weight_version(self) -> str | None:
        """``GET /weight_info`` (dev mode); None when the engine does not report one."""
        try:
            body = await self._dev("GET", "/weight_info")
        except EngineUnsupported:
            return None
        wv = body.get("weight_version") if isinstance(body, dict) else None
        return None if wv is None else str(wv)

    async def _server_config(self) -> dict | None:
        """``GET /server_info?config_format=json`` (dev mode): vLLM's own ``vllm_config``."""
        try:
            body = await self.http.request("GET", "/server_info?config_format=json", timeout=self.admin_timeout_s)
        except (EngineRejected, EngineBadResponse):
            return None
        cfg = body.get("vllm_config") if isinstance(body, dict) else None
        return cfg if isinstance(cfg, dict) else None

    @staticmethod
    def _runs_extension(cfg: dict | None) -> bool:
        """Whether vLLM was started with ``--worker-extension-cls`` naming Splice's extension."""
        parallel = cfg.get("parallel_config") if isinstance(cfg, dict) else None
        return isinstance(parallel, dict) and parallel.get("worker_extension_cls") == EXTENSION_QUALNAME

    async def _tied_head(self, cfg: dict | None, root: str | None) -> bool | None:
        """``tie_word_embeddings`` of the served model: from the engine's own config
        (``/server_info?config_format=json``, dev mode), else from ``root/config.json`` when that
        path is readable here (the engine runs on this host)."""
        if isinstance(cfg, dict):
            model_cfg = cfg.get("model_config")
            hf = model_cfg.get("hf_config") if isinstance(model_cfg, dict) else None
            tied = config_ties_head(hf) if isinstance(hf, dict) else None
            if tied is None and isinstance(hf, str) and "tie_word_embeddings" in hf:
                tied = '"tie_word_embeddings": true' in hf
            if tied is not None:
                return tied
        if root:
            try:
                import json

                with open(os.path.join(root, "config.json"), encoding="utf-8") as f:
                    return config_ties_head(json.load(f))
            except (OSError, ValueError):
                return None
        return None

    async def info(self) -> EngineInfo:
        """``/v1/models`` (``id``, ``root`` = model path, ``max_model_len``), ``/weight_info``,
        and whether the dev-mode control endpoints exist (``GET`` on a POST-only route answers
        405 where it exists, 404 where it does not)."""
        body = await self.http.request("GET", "/v1/models", timeout=self.admin_timeout_s)
        card = model_card(body)
        statuses = {p: await self.http.probe("GET", p) for p in ("/pause", "/resume", "/collective_rpc", "/update_weight_version")}
        can_pause = statuses["/pause"] == 405 and statuses["/resume"] == 405
        can_reload = statuses["/collective_rpc"] == 405 and statuses["/update_weight_version"] == 405
        version = await self.weight_version() if can_reload else None
        root = card.get("root")
        cfg = await self._server_config()
        self.extension = self._runs_extension(cfg)
        tied = await self._tied_head(cfg, str(root) if root else None)
        warnings: list[str] = []
        if not (can_pause and can_reload):
            missing = [p for p, st in statuses.items() if st != 405]
            warnings.append(f"{self.url}: no {', '.join(missing)}: {DEV_MODE_HINT}; until then pause and weight updates fail")
        if tied and can_reload and not self.extension:
            warnings.append(f"{self.url}: {TIED_HEAD_WARNING}")
        return EngineInfo(
            context_length=positive_int(card.get("max_model_len")),
            model_path=str(root) if root else None,
            served_model=str(card["id"]) if card.get("id") else None,
            weight_version=parse_version(version),
            can_pause=can_pause,
            can_reload=can_reload,
            tied_lm_head=tied,
            worker_extension=self.extension,
            warnings=tuple(warnings),
        )

    async def served_model(self) -> str:
        """The first model id ``/v1/models`` lists (``model`` is required in vLLM requests)."""
        body = expect_dict(await self.http.request("GET", "/v1/models", timeout=self.admin_timeout_s), self.url, "/v1/models")
        data = body.get("data") or []
        if not data or not isinstance(data[0], dict) or "id" not in data[0]:
            raise EngineBadResponse(f"{self.url}: /v1/models lists no model", replica=self.url)
        return str(data[0]["id"])

    async def health(self) -> bool:
        try:
            await self.http.request("GET", "/health", timeout=5.0, allow_empty=True)
        except EngineError:
            return False
        return True
