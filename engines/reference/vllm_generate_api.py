"""vLLM's token-in/token-out endpoint: ``POST /inference/v1/generate`` (vLLM 0.32), with images.

The subset Splice needs, with vLLM's field names and semantics
(``vllm/entrypoints/scale_out/token_in_token_out/{protocol,serving}.py``):

- request: ``request_id``, ``token_ids``, ``content_parts`` (``[{"type": "image_url", "url":
  "data:..."}]``, one per image in prompt order), ``sampling_params`` (a vLLM ``SamplingParams``
  object; unknown keys are ignored as its schema does), ``model``, ``return_token_ids``,
  ``output_mode`` (``"tokens"``), ``stream``, ``stream_options``;
- images: vLLM's prompt update for Qwen2-VL replaces each ``<|image_pad|>`` of the token prompt,
  in order, with the image's processor count, so the prompt carries ONE pad per image; the
  expanded prompt comes back in ``prompt_token_ids`` (with ``return_token_ids``) and the spans
  in ``mm_placeholders: {"image": [{"offset", "length"}]}``; every token coordinate (prompt
  logprobs, usage) is in the expanded prompt;
- logprobs are raw (vLLM's default ``logprobs_mode``: before temperature and ``logit_bias``),
  ``-inf`` clamped to -9999.0; ``prompt_logprobs`` is a list (first entry null) of
  ``{token_id: {"logprob", "rank", "decoded_token"}}``;
- ``finish_reason`` ``stop`` / ``length`` / ``abort``, ``stop_reason`` the matched stop id or
  string (null for EOS); ``POST /inference/v1/abort_requests {"request_ids"}`` aborts, and so does
  ``/pause?mode=abort``.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from .generator import Job, Snapshot
from .sglang_api import _bool, _int
from .state import SSE_DONE, BadRequest, ClientGone, EngineState, json_response, read_json, sse
from .vision import ImageInputError, check_no_images, expand_single_pads
from .vllm_api import _clamp, finish_reasons, vllm_error, vllm_sampling

REQUEST_PREFIX = "generate-tokens-"
# SamplingParams fields the reference engine only accepts at their no-op values.
UNSUPPORTED_SAMPLING = {
    "n": (None, 1), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0), "min_tokens": (None, 0), "allowed_token_ids": (None, []),
    "bad_words": (None, []), "structured_outputs": (None,), "prompt_logprob_token_ids": (None,),
    "logprob_token_ids": (None,), "thinking_token_budget": (None,), "repetition_detection": (None,),
}  # fmt: skip
UNSUPPORTED_TOP = {"features": (None,), "kv_transfer_params": (None,), "ec_transfer_params": (None,)}


def parse_request(body: dict, state: EngineState, request: Request) -> tuple[Job, dict]:
    """A /inference/v1/generate body -> (Job, response options). Raises BadRequest."""
    lm = state.lm
    model = body.get("model")
    if model is not None and model not in (state.served_model_name, state.tokenizer_path):
        raise BadRequest(f"The model `{model}` does not exist.", status=404)
    for key, allowed in UNSUPPORTED_TOP.items():
        if body.get(key) not in allowed:
            raise BadRequest(f"{key!r} is not supported by the reference engine")
    ids = body.get("token_ids")
    if not isinstance(ids, list) or not ids:
        raise BadRequest("token_ids: List should have at least 1 item after validation")
    ids = [_int(x, "token_ids[]") for x in ids]
    if any(t < 0 for t in ids):
        raise BadRequest("token_ids must not contain negative values")
    bad = [t for t in ids if t >= lm.vocab_size]
    if bad:
        raise BadRequest(f"Token id {bad[0]} is out of vocabulary")
    parts = body.get("content_parts") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) for p in parts):
        raise BadRequest("content_parts must be a list of objects")
    urls = []
    for part in parts:
        if part.get("type") != "image_url":
            raise BadRequest(f"content part type {part.get('type')!r} is not supported by the reference engine (only image_url)")
        urls.append(part.get("url"))
    vcfg = lm.vision
    spans: list = []
    try:
        if urls:
            if vcfg is None:
                raise BadRequest(f"{state.served_model_name} does not support image inputs")
            images = [state.images.process(u) for u in urls]
            ids, spans = expand_single_pads(ids, images, vcfg, server="vLLM 0.32's /inference/v1/generate (prompt updates)")
        else:
            check_no_images(ids, vcfg)
    except ImageInputError as e:
        raise BadRequest(str(e)) from None
    if len(ids) >= lm.context_len:
        raise BadRequest(
            f"This model's maximum context length is {lm.context_len} tokens. However, your request has {len(ids)} input tokens."
        )
    sp = body.get("sampling_params")
    if not isinstance(sp, dict):
        raise BadRequest("sampling_params: Field required")
    for key, allowed in UNSUPPORTED_SAMPLING.items():
        if sp.get(key) not in allowed:
            raise BadRequest(f"sampling_params.{key}={sp.get(key)!r} is not supported by the reference engine")
    g = {k: v for k, v in sp.items() if v is not None}
    max_tokens = _int(g["max_tokens"], "max_tokens") if "max_tokens" in g else lm.context_len - len(ids)
    params, logprobs, prompt_logprobs = vllm_sampling(g, lm, max_tokens)
    mode = body.get("output_mode") or "tokens"
    if mode != "tokens":
        raise BadRequest(f"output_mode={mode!r} is not supported by the reference engine (only 'tokens')")
    external = request.headers.get("x-request-id") or body.get("request_id") or uuid.uuid4().hex
    request_id = f"{REQUEST_PREFIX}{external}"
    rid = request_id if request_id not in state.inflight else f"{request_id}-{uuid.uuid4().hex[:8]}"
    job = Job(
        rid=rid,
        input_ids=ids,
        params=params,
        input_logprobs_from=0 if prompt_logprobs is not None else None,
        input_top_logprobs=prompt_logprobs or 0,
        images=tuple(spans),
    )
    stream_options = body.get("stream_options") or {}
    opts = {
        "request_id": request_id,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "return_token_ids": _bool(body.get("return_token_ids") or False, "return_token_ids"),
        "stream": _bool(body.get("stream") or False, "stream"),
        "include_usage": bool(isinstance(stream_options, dict) and stream_options.get("include_usage")),
        "created": int(time.time()),
        "placeholders": {"image": [{"offset": s.offset, "length": s.length} for s in spans]} if spans else None,
    }
    return job, opts


class _Render:
    """vLLM ``GenerateTokensResponse`` pieces for one request."""

    def __init__(self, state: EngineState, job: Job, opts: dict):
        self.state, self.job, self.opts = state, job, opts

    def reasons(self, snap: Snapshot) -> tuple[str | None, int | str | None]:
        return finish_reasons(snap, self.job.params.stop_token_ids)

    def logprobs(self, snap: Snapshot, start: int, end: int) -> dict | None:
        k = self.opts["logprobs"]
        if k is None:
            return None
        content = []
        for i in range(start, end):
            tid, lp, rank = snap.output_ids[i], snap.output_logprobs[i], snap.output_ranks[i]
            items = [(tid, lp, rank)]
            for r, (t, v) in enumerate(snap.output_top[i] if i < len(snap.output_top) else [], start=1):
                if t != tid:
                    items.append((t, v, r))
            top = [{"token_id": t, "logprob": _clamp(v), "rank": r} for t, v, r in items[: max(k, 1)]]
            content.append({"token_id": tid, "logprob": _clamp(lp), "rank": rank, "top_logprobs": top})
        return {"content": content}

    def prompt_logprobs(self, snap: Snapshot) -> list | None:
        k = self.opts["prompt_logprobs"]
        if k is None:
            return None
        tok = self.state.lm.tokenizer
        ids = self.job.input_ids
        out: list = [None]
        for pos in range(1, len(ids)):
            tid = ids[pos]
            entry = {str(tid): {"logprob": _clamp(snap.input_logprobs[pos]), "rank": snap.input_ranks[pos], "decoded_token": tok.decode([tid])}}
            top = snap.input_top[pos] if pos < len(snap.input_top) and snap.input_top[pos] else []
            for rank, (t, v) in enumerate(top[:k], start=1):
                entry.setdefault(str(t), {"logprob": _clamp(v), "rank": rank, "decoded_token": tok.decode([t])})
            out.append(entry)
        return out

    def usage(self, n_out: int) -> dict:
        n_in = len(self.job.input_ids)
        return {"prompt_tokens": n_in, "total_tokens": n_in + n_out, "completion_tokens": n_out, "prompt_tokens_details": None}

    def weight_versions(self, snap: Snapshot) -> list:
        n = len(snap.output_ids)
        return [{"version": snap.weight_version, "start": 0, "end": n}] if n else []

    def choice(self, snap: Snapshot, start: int) -> dict:
        finish, stop_reason = self.reasons(snap)
        return {
            "index": 0,
            "finish_reason": finish,
            "stop_reason": stop_reason,
            "token_ids": snap.output_ids[start:],
            "routed_experts": None,
            "sampling_mask": None,
            "weight_versions": self.weight_versions(snap) if snap.finish is not None else None,
            "logprobs": self.logprobs(snap, start, len(snap.output_ids)),
        }

    def full(self, snap: Snapshot) -> dict:
        o = self.opts
        return {
            "request_id": o["request_id"],
            "model": self.state.served_model_name,
            "created": o["created"],
            "usage": self.usage(len(snap.output_ids)),
            "prompt_logprobs": self.prompt_logprobs(snap),
            "prompt_token_id_logprobs": None,
            "prompt_token_ids": self.job.input_ids if o["return_token_ids"] else None,
            "mm_placeholders": o["placeholders"] if o["return_token_ids"] else None,
            "metrics": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "output_mode": "tokens",
            "choices": [self.choice(snap, 0)],
        }


async def _stream(state: EngineState, job: Job, watch, render: _Render):
    """Delta chunks (new token ids and their logprobs), the usage chunk if asked, then [DONE]."""
    o = render.opts
    sent = 0
    first = True
    try:
        async for snap in watch.updates():
            if len(snap.output_ids) == sent and snap.finish is None:
                continue
            chunk = {"request_id": o["request_id"], "usage": None, "output_mode": "tokens", "choices": [render.choice(snap, sent)]}
            if first and o["return_token_ids"]:
                chunk["prompt_token_ids"] = job.input_ids
                chunk["mm_placeholders"] = o["placeholders"]
            first = False
            sent = len(snap.output_ids)
            yield sse(chunk)
            if snap.finish is not None and o["include_usage"]:
                yield sse({"request_id": o["request_id"], "usage": render.usage(sent), "output_mode": "tokens", "choices": []})
        yield SSE_DONE
    finally:
        state.abort_if_running(job)
        state.release(job)


def make_router(state: EngineState) -> APIRouter:
    r = APIRouter()
    by_request: dict[str, set[str]] = {}  # request_id (with and without the prefix) -> internal rids

    def track(job: Job, request_id: str) -> None:
        for key in (request_id, request_id[len(REQUEST_PREFIX) :]):
            by_request.setdefault(key, set()).add(job.rid)

    def untrack(job: Job, request_id: str) -> None:
        for key in (request_id, request_id[len(REQUEST_PREFIX) :]):
            rids = by_request.get(key)
            if rids is not None:
                rids.discard(job.rid)
                if not rids:
                    del by_request[key]

    @r.post("/inference/v1/generate")
    async def generate(request: Request):
        try:
            body = await read_json(request)
            job, opts = await asyncio.to_thread(parse_request, body, state, request)
            watch = await state.admit(job, request)
        except BadRequest as e:
            return vllm_error(str(e), e.status, "NotFoundError" if e.status == 404 else "BadRequestError")
        except ClientGone:
            return Response(status_code=499)
        track(job, opts["request_id"])
        render = _Render(state, job, opts)
        if opts["stream"]:

            async def frames():
                try:
                    async for chunk in _stream(state, job, watch, render):
                        yield chunk
                finally:
                    untrack(job, opts["request_id"])

            return StreamingResponse(frames(), media_type="text/event-stream")
        try:
            snap = await watch.result(request)
        except ClientGone:
            state.abort_if_running(job)
            return Response(status_code=499)
        finally:
            state.release(job)
            untrack(job, opts["request_id"])
        return json_response(render.full(snap))

    async def abort_requests(request: Request):
        try:
            body = await read_json(request)
        except BadRequest as e:
            return json_response({"detail": str(e)}, 400)
        ids = body.get("request_ids")
        if ids is None:
            return json_response({"detail": "Missing 'request_ids' in request body"}, 400)
        for rid in [ids] if isinstance(ids, str) else list(ids):
            for internal in list(by_request.get(str(rid), ())):
                state.worker.abort(internal)
        return Response(status_code=200)

    r.add_api_route("/inference/v1/abort_requests", abort_requests, methods=["POST"])
    r.add_api_route("/abort_requests", abort_requests, methods=["POST"])
    return r
