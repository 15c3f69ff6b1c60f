"""The vLLM OpenAI-server subset: /v1/completions (token-id prompts), /v1/models, pause/resume.

Semantics follow vLLM 0.10+: ``max_tokens`` defaults to 16, logprobs are raw (not scaled by
temperature), ``-inf`` is clamped to -9999.0, with ``echo`` the logprobs cover the prompt then
the output (first prompt entry null), and ``return_tokens_as_token_ids`` names tokens
``"token_id:N"``. Unknown request fields are ignored, as vLLM does.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from .generator import Job, Snapshot, TopList
from .sampling import GenParams, check_ranges
from .sglang_api import _bool, _float, _int, _stop_ids, _stop_strs, check_input_ids
from .state import SSE_DONE, BadRequest, ClientGone, EngineState, json_response, read_json, sse
from .text import decode, output_text
from .vision import ImageInputError, check_no_images

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
CLAMP = -9999.0
UNSUPPORTED_DEFAULTS = {
    "n": (None, 1), "best_of": (None, 1), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0), "min_tokens": (None, 0),
    "allowed_token_ids": (None, []), "bad_words": (None, []), "suffix": (None, ""), "guided_json": (None,),
    "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,), "structured_outputs": (None,),
    "response_format": (None,), "use_beam_search": (None, False),
}  # fmt: skip


def vllm_error(message: str, status: int = 400, kind: str = "BadRequestError") -> Response:
    return json_response({"error": {"message": message, "type": kind, "param": None, "code": status}}, status)


def _clamp(lp: float | None) -> float | None:
    return None if lp is None else max(lp, CLAMP)


def vllm_logit_bias(v, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """vLLM's ``logit_bias``: token id (int or digit string) -> bias, clamped to [-100, 100]."""
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise BadRequest("logit_bias must be an object mapping token ids to biases")
    out = []
    for key, bias in v.items():
        try:
            tid = int(key)
        except (TypeError, ValueError):
            raise BadRequest(f"logit_bias contains key(s) that cannot be converted to token ids: {key!r}") from None
        if not 0 <= tid < vocab_size:
            raise BadRequest(f"token_id(s) [{tid}] in logit_bias contain out-of-vocab token ids. Vocabulary size: {vocab_size}")
        out.append((tid, min(100.0, max(-100.0, _float(bias, "logit_bias value")))))
    return tuple(out)


def finish_reasons(snap: Snapshot, stop_token_ids) -> tuple[str | None, int | str | None]:
    """vLLM's ``(finish_reason, stop_reason)`` of a snapshot (None, None while running)."""
    f = snap.finish
    if f is None:
        return None, None
    if f.type != "stop":
        return f.type, None
    if isinstance(f.matched, str) or (f.matched is not None and f.matched in stop_token_ids):
        return "stop", f.matched
    return "stop", None  # EOS: vLLM reports no stop_reason


def vllm_sampling(g: dict, lm, max_tokens: int) -> tuple[GenParams, int | None, int | None]:
    """vLLM's sampling fields (``/v1/completions`` body, ``/inference/v1/generate``
    ``sampling_params``; None values already dropped) -> (params, logprobs, prompt_logprobs)."""
    if max_tokens < 0:
        raise BadRequest(f"max_tokens must be at least 0, got {max_tokens}.")
    logprobs = _int(g["logprobs"], "logprobs") if "logprobs" in g else None
    prompt_logprobs = _int(g["prompt_logprobs"], "prompt_logprobs") if "prompt_logprobs" in g else None
    for name, v in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if v is not None and not 0 <= v <= MAX_LOGPROBS:
            raise BadRequest(f"Requested {name} of {v}, which is greater than max allowed: {MAX_LOGPROBS}" if v > 0 else f"{name} must be non-negative")
    top_k = _int(g.get("top_k", -1), "top_k")
    params = GenParams(
        max_new_tokens=max_tokens,
        temperature=_float(g.get("temperature", 1.0), "temperature"),
        top_p=_float(g.get("top_p", 1.0), "top_p"),
        top_k=-1 if top_k in (0, -1) else top_k,
        min_p=_float(g.get("min_p", 0.0), "min_p"),
        stop=_stop_strs(g.get("stop")),
        stop_token_ids=_stop_ids(g.get("stop_token_ids")),
        ignore_eos=_bool(g.get("ignore_eos", False), "ignore_eos"),
        seed=_int(g["seed"], "seed") if "seed" in g else None,
        scale_logprobs=False,
        top_logprobs=logprobs or 0,
        logit_bias=vllm_logit_bias(g.get("logit_bias"), lm.vocab_size),
        bias_logprobs=False,  # vLLM's default logprobs_mode is raw_logprobs
    )
    try:
        check_ranges(params)
    except ValueError as e:
        raise BadRequest(str(e)) from None
    return params, logprobs, prompt_logprobs


def parse_completion(body: dict, state: EngineState, request: Request) -> tuple[Job, dict]:
    """A /v1/completions body -> (Job, response options). Raises BadRequest."""
    lm = state.lm
    model = body.get("model")
    if model is not None and model not in (state.served_model_name, state.tokenizer_path):
        raise BadRequest(f"The model `{model}` does not exist.", status=404)
    for key, allowed in UNSUPPORTED_DEFAULTS.items():
        if body.get(key) not in allowed:
            raise BadRequest(f"{key!r}={body.get(key)!r} is not supported by the reference engine")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        prompt = list(lm.tokenizer(prompt, add_special_tokens=False)["input_ids"])
    if prompt is None:
        raise BadRequest("prompt is required")
    ids = check_input_ids(prompt, lm.vocab_size, lm.context_len)
    try:
        check_no_images(ids, lm.vision)
    except ImageInputError as e:
        raise BadRequest(f"{e} (/v1/completions takes no images here; use /inference/v1/generate with content_parts)") from None
    g = {k: v for k, v in body.items() if v is not None}
    max_tokens = _int(g["max_tokens"], "max_tokens") if "max_tokens" in g else (16 if "max_tokens" not in body else lm.context_len - len(ids))
    params, logprobs, prompt_logprobs = vllm_sampling(g, lm, max_tokens)
    echo = _bool(g.get("echo", False), "echo")
    want_prompt = prompt_logprobs is not None or (echo and logprobs is not None)
    rid = g.get("request_id") or request.headers.get("x-request-id") or uuid.uuid4().hex
    job = Job(
        rid=str(rid),
        input_ids=ids,
        params=params,
        input_logprobs_from=0 if want_prompt else None,
        input_top_logprobs=max(prompt_logprobs or 0, logprobs or 0) if want_prompt else 0,
    )
    stream_options = g.get("stream_options") or {}
    opts = {
        "echo": echo,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "as_ids": _bool(g.get("return_tokens_as_token_ids", False), "return_tokens_as_token_ids"),
        "return_token_ids": _bool(g.get("return_token_ids", False), "return_token_ids"),
        "skip_special_tokens": _bool(g.get("skip_special_tokens", True), "skip_special_tokens"),
        "spaces_between_special_tokens": _bool(g.get("spaces_between_special_tokens", True), "spaces_between_special_tokens"),
        "include_stop_str": _bool(g.get("include_stop_str_in_output", False), "include_stop_str_in_output"),
        "stream": _bool(g.get("stream", False), "stream"),
        "include_usage": bool(isinstance(stream_options, dict) and stream_options.get("include_usage")),
        "id": f"cmpl-{rid}",
        "created": int(time.time()),
    }
    return job, opts


class _Render:
    """Builds the vLLM-shaped pieces (text, logprobs, reasons) for one request."""

    def __init__(self, state: EngineState, job: Job, opts: dict):
        self.state, self.job, self.opts = state, job, opts
        self.tok = state.lm.tokenizer

    def name(self, tid: int) -> str:
        return f"token_id:{tid}" if self.opts["as_ids"] else self.tok.decode([tid])

    def prompt_text(self) -> str:
        return decode(self.tok, self.job.input_ids, skip_special_tokens=False)

    def text(self, snap: Snapshot) -> str:
        o = self.opts
        return output_text(
            self.tok,
            snap.output_ids,
            snap.finish,
            skip_special_tokens=o["skip_special_tokens"],
            spaces_between_special_tokens=o["spaces_between_special_tokens"],
            trim_stop_str=not o["include_stop_str"],
            trim_stop_token=False,
            stop=self.job.params.stop,
        )

    def reasons(self, snap: Snapshot) -> tuple[str | None, int | str | None]:
        return finish_reasons(snap, self.job.params.stop_token_ids)

    def top_dict(self, tid: int, lp: float, top: TopList, k: int) -> dict:
        items = [(tid, lp)] + [t for t in top[:k]]
        out: dict = {}
        for i, (t, v) in enumerate(items):
            if i > k:
                break
            out.setdefault(self.name(t), _clamp(v))
        return out

    def logprobs(self, ids, lps, tops, offset0: int) -> dict:
        """vLLM ``logprobs`` for a run of tokens (a null logprob marks the first prompt token)."""
        k = self.opts["logprobs"] or 0
        tokens, token_lps, top_lps, offsets = [], [], [], []
        last_len = 0
        for i, (tid, lp) in enumerate(zip(ids, lps)):
            name = self.name(tid)
            if lp is None:
                token_lps.append(None)
                top_lps.append(None)
            else:
                token_lps.append(_clamp(lp))
                top_lps.append(self.top_dict(tid, lp, tops[i] if i < len(tops) and tops[i] else [], k))
            offsets.append(offset0 if not offsets else offsets[-1] + last_len)
            last_len = len(name)
            tokens.append(name)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": top_lps, "text_offset": offsets}

    def prompt_logprobs(self, snap: Snapshot) -> list | None:
        k = self.opts["prompt_logprobs"]
        if k is None:
            return None
        out: list = [None]
        for pos in range(1, len(self.job.input_ids)):
            tid, lp = self.job.input_ids[pos], snap.input_logprobs[pos]
            entry = {str(tid): {"logprob": _clamp(lp), "rank": snap.input_ranks[pos], "decoded_token": self.name(tid)}}
            top = snap.input_top[pos] if pos < len(snap.input_top) and snap.input_top[pos] else []
            for rank, (t, v) in enumerate(top[:k], start=1):
                entry.setdefault(str(t), {"logprob": _clamp(v), "rank": rank, "decoded_token": self.name(t)})
            out.append(entry)
        return out

    def usage(self, snap: Snapshot) -> dict:
        n_in, n_out = len(self.job.input_ids), len(snap.output_ids)
        return {"prompt_tokens": n_in, "total_tokens": n_in + n_out, "completion_tokens": n_out, "prompt_tokens_details": None}

    def envelope(self, choices: list, usage: dict | None) -> dict:
        return {
            "id": self.opts["id"],
            "object": "text_completion",
            "created": self.opts["created"],
            "model": self.state.served_model_name,
            "choices": choices,
            "usage": usage,
        }

    def full(self, snap: Snapshot) -> dict:
        """The non-streaming response."""
        o = self.opts
        text = self.text(snap)
        ids, lps, tops = list(snap.output_ids), list(snap.output_logprobs), list(snap.output_top)
        if o["echo"]:
            text = self.prompt_text() + text
            if o["logprobs"] is not None:
                ids = self.job.input_ids + ids
                lps = list(snap.input_logprobs) + lps
                tops = list(snap.input_top or [None] * len(self.job.input_ids)) + tops
        finish, stop_reason = self.reasons(snap)
        choice = {
            "index": 0,
            "text": text,
            "logprobs": self.logprobs(ids, lps, tops, 0) if o["logprobs"] is not None else None,
            "finish_reason": finish,
            "stop_reason": stop_reason,
            "prompt_logprobs": self.prompt_logprobs(snap),
        }
        if o["return_token_ids"]:
            choice["prompt_token_ids"] = self.job.input_ids
            choice["token_ids"] = snap.output_ids
        return self.envelope([choice], self.usage(snap))


async def _stream(state: EngineState, job: Job, watch, render: _Render):
    """vLLM delta frames: text / token_ids / logprobs deltas, then usage (if asked) and [DONE]."""
    o = render.opts
    sent_text, sent_ids, offset = "", 0, 0
    try:
        first = True
        async for snap in watch.updates():
            text = render.text(snap)
            delta_text = text[len(sent_text) :] if text.startswith(sent_text) else text
            new_ids = snap.output_ids[sent_ids:]
            prefix = ""
            ids, lps, tops = list(new_ids), list(snap.output_logprobs[sent_ids:]), list(snap.output_top[sent_ids:])
            if first and o["echo"]:
                prefix = render.prompt_text()
                if o["logprobs"] is not None:
                    ids = job.input_ids + ids
                    lps = list(snap.input_logprobs) + lps
                    tops = list(snap.input_top or [None] * len(job.input_ids)) + tops
            if not new_ids and not prefix and snap.finish is None and not (first and o["return_token_ids"]):
                continue
            finish, stop_reason = render.reasons(snap)
            lp_obj = None
            if o["logprobs"] is not None:
                lp_obj = render.logprobs(ids, lps, tops, offset)
                if lp_obj["tokens"]:
                    offset = lp_obj["text_offset"][-1] + len(lp_obj["tokens"][-1])
            choice = {
                "index": 0,
                "text": prefix + delta_text,
                "logprobs": lp_obj,
                "finish_reason": finish,
                "stop_reason": stop_reason,
            }
            if o["return_token_ids"]:
                choice["token_ids"] = new_ids
                if first:
                    choice["prompt_token_ids"] = job.input_ids
            if first and o["prompt_logprobs"] is not None:
                choice["prompt_logprobs"] = render.prompt_logprobs(snap)
            first = False
            sent_text, sent_ids = text, len(snap.output_ids)
            yield sse(render.envelope([choice], None))
            if snap.finish is not None and o["include_usage"]:
                yield sse(render.envelope([], render.usage(snap)))
        yield SSE_DONE
    finally:
        state.abort_if_running(job)
        state.release(job)


def make_router(state: EngineState) -> APIRouter:
    r = APIRouter()

    @r.post("/v1/completions")
    async def completions(request: Request):
        try:
            job, opts = parse_completion(await read_json(request), state, request)
            watch = await state.admit(job, request)
        except BadRequest as e:
            kind = "NotFoundError" if e.status == 404 else "BadRequestError"
            return vllm_error(str(e), e.status, kind)
        except ClientGone:
            return Response(status_code=499)
        render = _Render(state, job, opts)
        if opts["stream"]:
            return StreamingResponse(_stream(state, job, watch, render), media_type="text/event-stream")
        try:
            snap = await watch.result(request)
        except ClientGone:
            state.abort_if_running(job)
            return Response(status_code=499)
        finally:
            state.release(job)
        return json_response(render.full(snap))

    @r.get("/v1/models")
    async def models():
        return json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": state.served_model_name,
                        "object": "model",
                        "created": int(state.started),
                        "owned_by": "splice",
                        "root": state.tokenizer_path,
                        "parent": None,
                        "max_model_len": state.lm.context_len,
                    }
                ],
            }
        )

    @r.post("/pause")
    async def pause(mode: str = "abort", clear_cache: bool = True):
        if mode not in ("abort", "wait", "keep"):
            return vllm_error(f"mode must be one of 'abort', 'wait', 'keep', got {mode!r}")
        if mode == "wait":
            state.running.clear()
            await asyncio.wrap_future(state.worker.drain())
            mode = "keep"
        await state.pause("abort" if mode == "abort" else "in_place")
        return json_response({"status": "paused"})

    @r.post("/resume")
    async def resume():
        await state.resume()
        return json_response({"status": "resumed"})

    @r.get("/is_paused")
    async def is_paused():
        return json_response({"is_paused": state.paused})

    # vLLM's development endpoints (VLLM_SERVER_DEV_MODE=1) for weight updates, same shapes:
    # collective_rpc("reload_weights", weights_path=...), update_weight_version, weight_info.
    @r.post("/collective_rpc")
    async def collective_rpc(request: Request):
        try:
            body = await read_json(request)
        except BadRequest as e:
            return json_response({"detail": str(e)}, 400)
        method = body.get("method")
        if method is None:
            return json_response({"detail": "Missing 'method' in request body"}, 400)
        if method != "reload_weights":
            return vllm_error(f"Call to collective_rpc method failed: the reference engine has no worker method {method!r}", 500, "InternalServerError")
        kwargs = body.get("kwargs") or {}
        path = kwargs.get("weights_path") or state.worker.model_path
        ok, message = await asyncio.wrap_future(state.worker.update_weights(str(path), None))
        if not ok:
            return vllm_error(f"Call to collective_rpc method failed: Worker failed with error '{message}'", 500, "InternalServerError")
        return json_response({"results": [None]})

    @r.post("/update_weight_version")
    async def update_weight_version(request: Request):
        try:
            body = await read_json(request)
        except BadRequest as e:
            return json_response({"detail": str(e)}, 400)
        new_version = body.get("new_version")
        if not isinstance(new_version, str):
            return json_response({"detail": [{"type": "missing", "loc": ["body", "new_version"], "msg": "Field required"}]}, 422)
        state.worker.weight_version = new_version
        return json_response({"success": True, "new_version": new_version})

    @r.get("/weight_info")
    async def weight_info():
        return json_response({"weight_version": state.worker.weight_version})

    return r
