"""Async client for SGLang's native ``/generate`` API and its admin endpoints (docs/design.md section 9).

Splice talks to SGLang in token space only: ``input_ids`` in, ``meta_info`` logprob triples
out. Only sampling keys SGLang knows are sent (0.5.23 answers unknown ones with HTTP 400), and
input logprobs are requested (``logprob_start_len >= 0``) only when a token is owed one,
because that also caps prefix-cache reuse at that position.
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from operator import itemgetter
from typing import Any, Sequence

import httpx
import numpy as np

from engines.client import TokensCallback, model_card, positive_int, prefill_values
from engines.http import Http, clean_logprobs, deadline, expect_dict, id_list, token_list, weight_version_spans
from engines.ids_json import IdsJson
from engines.images import check_spans, collapse, data_url, in_image, stop_and_ban
from engines.resume import parse_version
from engines.weight_transfer import TensorBatch, WeightGroup, sglang_init_body, sglang_update_body
from engines.types import (
    EngineBadResponse,
    EngineError,
    EngineImage,
    EngineInfo,
    EngineRejected,
    EngineUnavailable,
    FinishReason,
    SamplingParams,
    Segment,
)

_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}
# sgl-router / smg route requests with the same key to the same worker (prefix-cache affinity).
ROUTING_HEADER = "X-SMG-Routing-Key"


def routing_value(key: str) -> str:
    """The session id as a header value; ids that are not plain ASCII are sent as a stable hash."""
    if key.isascii() and key.isprintable() and len(key) <= 256:
        return key
    return hashlib.blake2b(key.encode("utf-8"), digest_size=16).hexdigest()


def sampling_payload(params: SamplingParams) -> dict[str, Any]:
    """SGLang ``sampling_params``: exactly the keys SGLang accepts, optional ones only when set."""
    sp: dict[str, Any] = {
        "max_new_tokens": int(params.max_new_tokens),
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "top_k": int(params.top_k),
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    sp.update(stop_and_ban(params))
    return sp


def generate_payload(
    input_ids: list[int],
    params: SamplingParams,
    *,
    rid: str,
    logprob_start_len: int,
    stream: bool,
    images: Sequence[EngineImage] = (),
    encoded_ids: Any = None,
) -> dict[str, Any]:
    """The ``/generate`` body. ``logprob_start_len`` is -1 unless input logprobs are owed.
    ``encoded_ids``: ``input_ids`` as the body carries them, when already encoded (``IdsJson``).

    With ``images`` (spans of the expanded ``input_ids``), each span goes out collapsed to one
    ``<|image_pad|>`` and ``image_data`` lists the images as data URLs in prompt order: SGLang's
    Qwen-VL processor expands a single pad per image itself and rejects pre-expanded runs.
    ``logprob_start_len`` stays in expanded coordinates (SGLang applies it after expansion).
    """
    if images:
        check_spans(input_ids, images)
        return {
            "input_ids": [int(t) for t in collapse(input_ids, images)],
            "image_data": [data_url(img) for img in images],
            "sampling_params": sampling_payload(params),
            "return_logprob": True,
            "logprob_start_len": int(logprob_start_len),
            "rid": rid,
            "stream": bool(stream),
        }
    return {
        "input_ids": token_list(input_ids) if encoded_ids is None else encoded_ids,
        "sampling_params": sampling_payload(params),
        "return_logprob": True,
        "logprob_start_len": int(logprob_start_len),
        "rid": rid,
        "stream": bool(stream),
    }


_ENTRY_TYPES = {list, tuple}
_LOGPROB, _TOKEN = itemgetter(0), itemgetter(1)


def _triples(meta: dict, key: str, replica: str) -> list:
    value = meta.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise EngineBadResponse(f"{replica}: meta_info.{key} is not a list", replica=replica)
    if set(map(type, value)) <= _ENTRY_TYPES and min(map(len, value), default=2) >= 2:
        return value  # every entry checked in C: the usual reply, however long
    for entry in value:
        if not isinstance(entry, (list, tuple)) or len(entry) < 2:
            raise EngineBadResponse(f"{replica}: malformed meta_info.{key} entry {entry!r}", replica=replica)
    return value


def _token_ids(triples: list) -> list:
    """The entries' token ids as they came (ints on the wire; anything else is the caller's to check)."""
    return list(map(_TOKEN, triples))


def output_tokens(meta: dict, replica: str, skip: int = 0) -> tuple[list[int], list[float]]:
    """Output ids and behaviour logprobs from ``[lp, id, null]`` triples (from entry ``skip``:
    a stream frame repeats every earlier token)."""
    triples = _triples(meta, "output_token_logprobs", replica)
    if skip:
        triples = triples[skip:]
    ids = _token_ids(triples)
    if not set(map(type, ids)) <= {int}:
        try:
            ids = [int(t) for t in ids]
        except (TypeError, ValueError):
            raise EngineBadResponse(f"{replica}: non-integer token id in output_token_logprobs", replica=replica) from None
    return ids, clean_logprobs(list(map(_LOGPROB, triples)))


def input_logprobs(
    meta: dict, input_ids: list[int], start: int, replica: str, images: Sequence[EngineImage] = ()
) -> list[float | None]:
    """Input logprobs for absolute positions ``start..``; the first (null) entry stays None.

    Each entry's token id is checked against ``input_ids`` at its absolute position, so an
    off-by-one between request and reply is an error, never a silently misplaced value. At an
    image's pad positions SGLang reports id 0 (its per-image pad sentinel, clipped in
    ``scheduler_components/logprob_result_processor.py``), so those ids are not compared.
    """
    triples = _triples(meta, "input_token_logprobs", replica)
    if start < 0 or not triples:
        return []
    if start + len(triples) > len(input_ids):
        raise EngineBadResponse(
            f"{replica}: {len(triples)} input logprobs from position {start} exceed the prompt ({len(input_ids)})",
            replica=replica,
        )
    for j in _id_mismatches(_token_ids(triples), input_ids, start):
        if not (images and in_image(start + j, images)):
            tid = triples[j][1]
            raise EngineBadResponse(
                f"{replica}: input logprob {j} is for token {tid}, expected {input_ids[start + j]} at position {start + j}",
                replica=replica,
            )
    raw = list(map(_LOGPROB, triples))
    out: list[float | None] = clean_logprobs(raw)
    if raw[0] is None:
        out[0] = None
    return out


def _id_mismatches(tids: list, input_ids, start: int) -> list[int]:
    """Offsets ``j`` where an int id differs from ``input_ids[start + j]`` (others are not compared)."""
    expected = id_list(input_ids[start : start + len(tids)])
    if set(map(type, tids)) <= {int}:
        if tids == expected:  # the usual reply: one C-level compare
            return []
        try:  # an image's pads (id 0) differ at every position: thousands in a long prefill
            return np.flatnonzero(np.asarray(tids, dtype=np.int64) != np.asarray(expected, dtype=np.int64)).tolist()
        except OverflowError:  # an id past int64: compared one by one below
            pass
    return [j for j, tid in enumerate(tids) if isinstance(tid, int) and tid != expected[j]]


def check_expansion(meta: dict, input_ids: list[int], images: Sequence[EngineImage], replica: str) -> None:
    """The engine expanded the collapsed prompt to exactly Splice's expanded length; if not,
    its image processor (min/max pixels, merge size) differs from the one Splice rendered with
    and every position after the first image would be misplaced."""
    reported = meta.get("prompt_tokens")
    if not images or not isinstance(reported, int) or reported == 0:
        return  # text-only, or aborted before the prompt was processed
    if reported != len(input_ids):
        sizes = ", ".join(f"{img.length}" for img in images)
        raise EngineBadResponse(
            f"{replica}: the engine expanded the {len(images)}-image prompt to {reported} tokens, Splice to "
            f"{len(input_ids)} (image tokens per image here: {sizes}); the engine's image processor settings "
            "(min_pixels / max_pixels / merge size) differ from the model folder Splice renders with",
            replica=replica,
            retryable=False,
        )


def parse_response(
    body: Any, input_ids: list[int], logprob_start_len: int, replica: str, images: Sequence[EngineImage] = ()
) -> Segment:
    """A final ``/generate`` reply (or last stream frame) as a ``Segment``."""
    body = expect_dict(body, replica, "/generate")
    meta = body.get("meta_info")
    if not isinstance(meta, dict):
        raise EngineBadResponse(f"{replica}: /generate reply has no meta_info", replica=replica)
    check_expansion(meta, input_ids, images, replica)
    ids, lps = output_tokens(meta, replica)
    wire_ids = body.get("output_ids")
    if isinstance(wire_ids, list) and wire_ids and wire_ids != ids:
        raise EngineBadResponse(f"{replica}: output_ids disagree with output_token_logprobs", replica=replica)
    fr = meta.get("finish_reason")
    if not isinstance(fr, dict) or fr.get("type") not in _FINISH:
        raise EngineBadResponse(f"{replica}: missing or unknown finish_reason {fr!r}", replica=replica)
    matched = fr.get("matched")
    if not isinstance(matched, (int, str)) or isinstance(matched, bool):
        matched = None
    wv = meta.get("weight_version")
    return Segment(
        output_ids=ids,
        logprobs=lps,
        finish_reason=_FINISH[fr["type"]],
        matched_stop=matched,
        input_logprobs=input_logprobs(meta, input_ids, logprob_start_len, replica, images),
        input_logprobs_start=max(logprob_start_len, 0),
        prompt_tokens=int(meta.get("prompt_tokens") or 0),
        cached_tokens=int(meta.get("cached_tokens") or 0),
        weight_version=None if wv is None else str(wv),
        weight_version_spans=weight_version_spans(meta.get("weight_versions")),
    )


class SGLangClient:
    """One SGLang replica (or an ``sgl-router`` in front of several)."""

    kind = "sglang"

    def __init__(self, client: httpx.AsyncClient, url: str, *, timeout_s: float = 600.0, admin_timeout_s: float = 60.0):
        self.http = Http(client, url)
        self.url = self.http.url
        self.timeout_s = timeout_s
        self.admin_timeout_s = admin_timeout_s
        self.ids_json = IdsJson()  # each session's last long prompt as JSON: the next one appends to it

    # -- generation -----------------------------------------------------------------------------

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
        start = -1 if input_logprobs_from is None else max(input_logprobs_from - 1, 0)
        payload = generate_payload(
            input_ids, params, rid=rid, logprob_start_len=start, stream=on_tokens is not None, images=images,
            encoded_ids=None if images else self.ids_json(routing_key, input_ids),
        )  # fmt: skip
        headers = {ROUTING_HEADER: routing_value(routing_key)} if routing_key else None
        try:
            if on_tokens is None:
                body = await self.http.request("POST", "/generate", body=payload, timeout=self.timeout_s, headers=headers)
                return parse_response(body, input_ids, start, self.url, images)
            async with deadline(self.timeout_s, self.url, "/generate"):  # total, not per read
                return await self._stream(payload, input_ids, start, on_tokens, headers, images)
        except (EngineUnavailable, EngineRejected):
            raise  # the request is not running on the engine
        except BaseException:
            # Cancelled (the agent went away), timed out, or the stream consumer failed: the
            # engine may still be generating for nobody.
            await self._abort_quietly(rid)
            raise

    async def _stream(
        self,
        payload: dict,
        input_ids: list[int],
        start: int,
        on_tokens: TokensCallback,
        headers: dict[str, str] | None,
        images: Sequence[EngineImage] = (),
    ) -> Segment:
        emitted = 0
        last: dict | None = None
        seen_input: list | None = None
        async with self.http.stream("/generate", payload, timeout=self.timeout_s, headers=headers) as resp:
            async for frame in self.http.sse(resp, "/generate"):
                meta = frame.get("meta_info")
                if not isinstance(meta, dict):
                    raise EngineBadResponse(f"{self.url}: stream frame without meta_info", replica=self.url)
                check_expansion(meta, input_ids, images, self.url)  # before any token is passed on
                if meta.get("input_token_logprobs"):
                    seen_input = meta["input_token_logprobs"]
                ids, lps = output_tokens(meta, self.url, skip=emitted)  # frames are cumulative (SGLang's default)
                if ids:
                    await on_tokens(ids, lps)
                    emitted += len(ids)
                last = frame
        if last is None:
            raise EngineBadResponse(f"{self.url}: empty /generate stream", replica=self.url)
        if seen_input is not None and not last["meta_info"].get("input_token_logprobs"):
            last["meta_info"]["input_token_logprobs"] = seen_input
        return parse_response(last, input_ids, start, self.url, images)

    async def prefill(
        self,
        input_ids: list[int],
        start: int,
        *,
        routing_key: str | None = None,
        images: Sequence[EngineImage] = (),
    ) -> tuple[list[float], str | None]:
        """A prefill-only call: ``max_new_tokens: 0``, ``logprob_start_len = start - 1``."""
        if not 1 <= start <= len(input_ids):
            raise ValueError(f"prefill start must be in [1, {len(input_ids)}], got {start}")
        params = SamplingParams(max_new_tokens=0)
        rid = f"splice-prefill-{uuid.uuid4().hex}"
        seg = await self.generate(
            input_ids, params, rid=rid, input_logprobs_from=start, routing_key=routing_key, images=images
        )
        return prefill_values(seg, input_ids, start, self.url), seg.weight_version

    async def abort(self, rid: str) -> None:
        await self.http.request("POST", "/abort_request", body={"rid": rid}, timeout=5.0, allow_empty=True)

    async def _abort_quietly(self, rid: str) -> None:
        """Tell the engine to drop ``rid`` (the caller went away); never raises, never blocks long."""
        task = asyncio.ensure_future(self.abort(rid))
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout=5.0)
        except BaseException:  # noqa: BLE001 - best effort, the original error wins
            pass

    # -- admin ----------------------------------------------------------------------------------

    async def pause(self) -> None:
        await self.http.request("POST", "/pause_generation", body={"mode": "abort"}, timeout=self.admin_timeout_s,
                                allow_empty=True, idempotent=True)

    async def resume(self) -> None:
        await self.http.request("POST", "/continue_generation", body={}, timeout=self.admin_timeout_s, allow_empty=True,
                                idempotent=True)

    async def update_weights(self, model_path: str, version: int) -> None:
        body = await self.http.request(
            "POST",
            "/update_weights_from_disk",
            body={"model_path": model_path, "weight_version": str(version), "flush_cache": True},
            timeout=self.timeout_s,
        )
        body = expect_dict(body, self.url, "/update_weights_from_disk")
        if body.get("success") is not True:
            raise EngineRejected(
                f"{self.url}: update_weights_from_disk({model_path!r}) failed: {body.get('message', body)}",
                replica=self.url,
            )

    # -- weights over torch.distributed (docs/engines.md) ----------------------------------------

    async def _success(self, path: str, body: dict, what: str) -> None:
        reply = expect_dict(await self.http.request("POST", path, body=body, timeout=self.timeout_s), self.url, path)
        if reply.get("success") is not True:
            raise EngineRejected(f"{self.url}: {what} failed: {reply.get('message', reply)}", replica=self.url)

    async def weight_ranks(self) -> int:
        """How many ranks this server joins a weight-update group with: its tensor-parallel size
        (``/server_info`` ``tp_size``; rank ``rank_offset + tp_rank`` each)."""
        return positive_int((await self._get_first("/server_info", "/get_server_info")).get("tp_size")) or 1

    async def init_weights_group(self, group: WeightGroup) -> None:
        """``/init_weights_update_group``: answers once the engine joined (the trainer's rank 0
        must be joining at the same time)."""
        await self._success("/init_weights_update_group", sglang_init_body(group), f"init_weights_update_group({group.group_name!r})")

    async def update_weights_from_distributed(self, batch: TensorBatch) -> None:
        """``/update_weights_from_distributed``: answers once the bucket was received and loaded."""
        await self._success("/update_weights_from_distributed", sglang_update_body(batch), f"update_weights_from_distributed(v{batch.version})")

    async def destroy_weights_group(self, group_name: str) -> None:
        await self._success("/destroy_weights_update_group", {"group_name": group_name}, f"destroy_weights_update_group({group_name!r})")

    async def weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """``/get_weights_by_name``: the first ``truncate_size`` rows of a parameter, as floats."""
        body = await self.http.request("POST", "/get_weights_by_name", body={"name": name, "truncate_size": int(truncate_size)}, timeout=self.timeout_s)
        if not isinstance(body, list):
            raise EngineBadResponse(f"{self.url}/get_weights_by_name: expected a list, got {type(body).__name__}", replica=self.url)
        return body

    async def weight_version(self) -> str | None:
        try:
            body = await self.http.request("GET", "/model_info", timeout=self.admin_timeout_s)
        except EngineRejected:  # releases before /model_info only have /get_model_info
            body = await self.http.request("GET", "/get_model_info", timeout=self.admin_timeout_s)
        wv = expect_dict(body, self.url, "/model_info").get("weight_version")
        return None if wv is None else str(wv)

    async def set_weight_version(self, version: int) -> None:
        """Nothing to tell: SGLang reports the version with every response (``meta_info``) and
        learns one when it loads weights (``update_weights_from_disk`` / ``_from_distributed``)."""

    async def health(self) -> bool:
        try:
            await self.http.request("GET", "/health", timeout=5.0, allow_empty=True)
        except EngineError:
            return False
        return True

    async def _get_first(self, *paths: str) -> dict:
        """The JSON object of the first of ``paths`` that answers (newer name first); {} if none.
        Raises ``EngineUnavailable`` when the replica cannot be reached."""
        for path in paths:
            try:
                body = await self.http.request("GET", path, timeout=self.admin_timeout_s)
            except (EngineRejected, EngineBadResponse):
                continue
            if isinstance(body, dict):
                return body
        return {}

    async def info(self) -> EngineInfo:
        """``/v1/models`` (``max_model_len``: SGLang's resolved context length, ``id``),
        ``/model_info`` (``model_path``, ``weight_version``), ``/server_info`` (the
        ``context_length`` server argument, when ``/v1/models`` lacks it), and which control
        endpoints exist (``GET`` on a POST route answers 405 where it exists)."""
        card = model_card(await self._get_first("/v1/models"))
        minfo = await self._get_first("/model_info", "/get_model_info")
        context = positive_int(card.get("max_model_len"))
        if context is None:
            context = positive_int((await self._get_first("/server_info", "/get_server_info")).get("context_length"))
        statuses = [await self.http.probe("GET", p) for p in ("/pause_generation", "/continue_generation", "/update_weights_from_disk")]
        can_pause = statuses[0] == 405 and statuses[1] == 405
        can_reload = statuses[2] == 405
        warnings: list[str] = []
        if not can_pause:
            warnings.append(f"{self.url}: no /pause_generation + /continue_generation (HTTP {statuses[:2]}); pausing for weight updates will fail")
        if not can_reload:
            warnings.append(f"{self.url}: no /update_weights_from_disk (HTTP {statuses[2]}); load weights yourself and set the version")
        served = card.get("id") or minfo.get("served_model_name")
        path = minfo.get("model_path") or card.get("root")
        return EngineInfo(
            context_length=context,
            model_path=str(path) if path else None,
            served_model=str(served) if served else None,
            weight_version=parse_version(minfo.get("weight_version")),
            can_pause=can_pause,
            can_reload=can_reload,
            tied_lm_head=None,
            warnings=tuple(warnings),
        )

