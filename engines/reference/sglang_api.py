"""The SGLang native API subset: /generate, pause/continue, abort, weight updates, info.

Request validation follows SGLang 0.5.x: unknown ``sampling_params`` keys, a ``rid`` still in
flight, a ``logprob_start_len`` past the prompt are HTTP 400. Features SGLang has but this
engine does not implement (penalties, grammars, n > 1, ...) are rejected with a 400 that says
so rather than silently ignored.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from .generator import Finish, Job, Snapshot
from .sampling import GenParams, check_ranges
from .state import SSE_DONE, BadRequest, ClientGone, EngineState, error_response, json_response, read_json, sse
from .text import output_text
from .vision import ImageInputError, check_no_images, expand_single_pads

SAMPLING_KEYS = {
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
    "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n",
    "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "custom_params", "stream_interval",
    "logit_bias", "sampling_seed",
}  # fmt: skip
# SGLang knows these; the reference engine only accepts their no-op values.
UNSUPPORTED_DEFAULTS = {
    "stop_regex": (None, [], ""), "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0), "min_new_tokens": (0,), "n": (1,), "json_schema": (None,),
    "regex": (None,), "ebnf": (None,), "structural_tag": (None,), "custom_params": (None, {}),
}  # fmt: skip
# Top-level /generate fields the reference engine cannot honour unless left at these values.
UNSUPPORTED_TOP = {
    "input_embeds": (None,), "audio_data": (None, []), "video_data": (None, []),
    "lora_path": (None,), "custom_logit_processor": (None,), "token_ids_logprob": (None, []),
    "return_hidden_states": (None, False),
}  # fmt: skip
MAX_TOP_LOGPROBS = 20


def _int(v, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
        raise BadRequest(f"{name} must be an integer, got {v!r}")
    return int(v)


def _float(v, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadRequest(f"{name} must be a number, got {v!r}")
    return float(v)


def _bool(v, name: str) -> bool:
    if not isinstance(v, bool):
        raise BadRequest(f"{name} must be a boolean, got {v!r}")
    return v


def _stop_strs(v) -> tuple[str, ...]:
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,) if v else ()
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return tuple(s for s in v if s)
    raise BadRequest(f"stop must be a string or a list of strings, got {v!r}")


def _stop_ids(v) -> frozenset[int]:
    if v is None:
        return frozenset()
    if not isinstance(v, list):
        raise BadRequest(f"stop_token_ids must be a list of integers, got {v!r}")
    return frozenset(_int(x, "stop_token_ids[]") for x in v if x is not None)


def check_input_ids(ids, vocab_size: int, context_len: int) -> list[int]:
    """Validate a flat list of token ids for one prompt."""
    if not isinstance(ids, list) or not ids:
        raise BadRequest("input_ids must be a non-empty list of token ids")
    if isinstance(ids[0], list):
        raise BadRequest("batch requests (a list of prompts) are not supported by the reference engine; send one request per prompt")
    out = [_int(x, "input_ids[]") for x in ids]
    bad = [x for x in out if not 0 <= x < vocab_size]
    if bad:
        raise BadRequest(f"token id {bad[0]} is out of range [0, {vocab_size})")
    if len(out) >= context_len:
        raise BadRequest(f"The input ({len(out)} tokens) is longer than the model's context length ({context_len} tokens).")
    return out


def _logit_bias(v, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """SGLang's ``logit_bias``: ``{"token id as a string": bias}``, added to the logits before sampling."""
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise BadRequest(f"logit_bias must be an object mapping token ids to biases, got {v!r}")
    out = []
    for key, bias in v.items():
        try:
            tid = int(key)
        except (TypeError, ValueError):
            raise BadRequest(f"logit_bias keys must be token ids, got {key!r}") from None
        if not 0 <= tid < vocab_size:
            raise BadRequest(f"logit_bias must has keys in [0, {vocab_size - 1}], got {key}.")
        out.append((tid, _float(bias, f"logit_bias[{key!r}]")))
    return tuple(out)


def parse_sampling(sp: dict, vocab_size: int = 1 << 31) -> tuple[GenParams, dict]:
    """SGLang ``sampling_params`` -> (GenParams, text options). Raises BadRequest."""
    if not isinstance(sp, dict):
        raise BadRequest("sampling_params must be an object")
    unknown = sorted(set(sp) - SAMPLING_KEYS)
    if unknown:
        raise BadRequest(f"Unknown sampling parameter(s) {unknown}; SamplingParams accepts {sorted(SAMPLING_KEYS)}")
    for key, allowed in UNSUPPORTED_DEFAULTS.items():
        if key in sp and sp[key] not in allowed:
            raise BadRequest(f"sampling parameter {key!r}={sp[key]!r} is not supported by the reference engine")
    g = {k: v for k, v in sp.items() if v is not None}  # SGLang: null means "use the default"
    temperature = _float(g.get("temperature", 1.0), "temperature")
    top_k = _int(g.get("top_k", -1), "top_k")
    if top_k == 0 or top_k < -1:
        raise BadRequest(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    params = GenParams(
        max_new_tokens=_int(g.get("max_new_tokens", 128), "max_new_tokens"),
        temperature=temperature,
        top_p=_float(g.get("top_p", 1.0), "top_p"),
        top_k=top_k,
        min_p=_float(g.get("min_p", 0.0), "min_p"),
        stop=_stop_strs(g.get("stop")),
        stop_token_ids=_stop_ids(g.get("stop_token_ids")),
        ignore_eos=_bool(g.get("ignore_eos", False), "ignore_eos"),
        seed=_int(g["sampling_seed"], "sampling_seed") if "sampling_seed" in g else None,
        scale_logprobs=True,
        logit_bias=_logit_bias(g.get("logit_bias"), vocab_size),
        bias_logprobs=True,  # SGLang reports logprobs of the processed (biased, tempered) logits
    )
    try:
        check_ranges(params)
    except ValueError as e:
        raise BadRequest(str(e)) from None
    text_opts = {
        "skip_special_tokens": _bool(g.get("skip_special_tokens", True), "skip_special_tokens"),
        "spaces_between_special_tokens": _bool(g.get("spaces_between_special_tokens", True), "spaces_between_special_tokens"),
        "no_stop_trim": _bool(g.get("no_stop_trim", False), "no_stop_trim"),
    }
    return params, text_opts


def parse_generate(body: dict, state: EngineState) -> tuple[Job, dict]:
    """A /generate body -> (Job, response options). Raises BadRequest."""
    for key, allowed in UNSUPPORTED_TOP.items():
        if body.get(key) not in allowed:
            raise BadRequest(f"{key!r} is not supported by the reference engine")
    lm = state.lm
    if body.get("input_ids") is not None:
        ids = check_input_ids(body["input_ids"], lm.vocab_size, lm.context_len)
    elif isinstance(body.get("text"), str):
        ids = check_input_ids(list(lm.tokenizer(body["text"], add_special_tokens=False)["input_ids"]), lm.vocab_size, lm.context_len)
    elif body.get("text") is not None:
        raise BadRequest("batch requests (a list of prompts) are not supported by the reference engine; send one request per prompt")
    else:
        raise BadRequest("Either text or input_ids should be provided.")
    ids, images = attach_images(ids, body.get("image_data"), state)
    params, text_opts = parse_sampling(body.get("sampling_params") or {}, lm.vocab_size)
    return_logprob = _bool(body.get("return_logprob") or False, "return_logprob")
    start = body.get("logprob_start_len")
    start = -1 if start is None else _int(start, "logprob_start_len")
    if start < -1:
        raise BadRequest(f"logprob_start_len must be -1 or a prompt position, got {start}")
    if return_logprob and start >= len(ids):
        raise BadRequest(
            f"logprob_start_len={start} is higher than the number of input tokens {len(ids)}. Please use a smaller logprob_start_len."
        )
    top_n = _int(body.get("top_logprobs_num") or 0, "top_logprobs_num")
    if not 0 <= top_n <= MAX_TOP_LOGPROBS:
        raise BadRequest(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], got {top_n}")
    rid = body.get("rid")
    if rid is None:
        rid = uuid.uuid4().hex
    elif not isinstance(rid, str) or not rid:
        raise BadRequest("rid must be a non-empty string")
    if return_logprob and top_n:
        params = dataclasses.replace(params, top_logprobs=top_n)
    job = Job(
        rid=rid,
        input_ids=ids,
        params=params,
        input_logprobs_from=start if (return_logprob and start >= 0) else None,
        input_top_logprobs=top_n if return_logprob else 0,
        images=tuple(images),
    )
    opts = {
        **text_opts,
        "return_logprob": return_logprob,
        "logprob_start_len": start,
        "top_logprobs_num": top_n,
        "return_text_in_logprobs": _bool(body.get("return_text_in_logprobs") or False, "return_text_in_logprobs"),
        "stream": _bool(body.get("stream") or False, "stream"),
    }
    return job, opts


def attach_images(ids: list[int], image_data, state: EngineState) -> tuple[list[int], list]:
    """Expand each image's single ``<|image_pad|>`` in ``ids`` to its processor count (as SGLang's
    ``build_input_ids``); returns ``(expanded ids, image spans)``. Raises BadRequest."""
    vcfg = state.lm.vision
    if image_data is None or image_data == []:
        try:
            check_no_images(ids, vcfg)
        except ImageInputError as e:
            raise BadRequest(str(e)) from None
        return ids, []
    if vcfg is None:
        raise BadRequest(f"image_data was sent but the served model ({state.served_model_name}) is not a vision-language model")
    urls = [image_data] if isinstance(image_data, str) else image_data
    if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
        raise BadRequest("image_data must be a data URL or a list of data URLs (one per image, in prompt order)")
    try:
        images = [state.images.process(u) for u in urls]
        ids, spans = expand_single_pads(ids, images, vcfg, server="SGLang's /generate (build_input_ids)")
    except ImageInputError as e:
        raise BadRequest(str(e)) from None
    if len(ids) >= state.lm.context_len:
        raise BadRequest(f"The input ({len(ids)} tokens) is longer than the model's context length ({state.lm.context_len} tokens).")
    return ids, spans


def finish_json(f: Finish | None, params: GenParams) -> dict | None:
    if f is None:
        return None
    if f.type == "length":
        return {"type": "length", "length": params.max_new_tokens}
    if f.type == "abort":
        return {"type": "abort", "message": f.message or "Aborted"}
    out: dict = {"type": "stop"}
    if f.matched is not None:
        out["matched"] = f.matched
    return out


def build_response(state: EngineState, job: Job, snap: Snapshot, opts: dict, t0: float) -> dict:
    """The /generate response body (also each cumulative stream frame)."""
    tok = state.lm.tokenizer
    text = output_text(
        tok,
        snap.output_ids,
        snap.finish,
        skip_special_tokens=opts["skip_special_tokens"],
        spaces_between_special_tokens=opts["spaces_between_special_tokens"],
        trim_stop_str=not opts["no_stop_trim"],
        trim_stop_token=not opts["no_stop_trim"],
        stop=job.params.stop,
    )
    meta = {
        "id": job.rid,
        "finish_reason": finish_json(snap.finish, job.params),
        "prompt_tokens": len(job.input_ids),
        "completion_tokens": len(snap.output_ids),
        "cached_tokens": job.cached_tokens,
        "weight_version": snap.weight_version or state.worker.weight_version,
        "e2e_latency": time.monotonic() - t0,
    }
    if opts["return_logprob"]:
        with_text = opts["return_text_in_logprobs"]

        def entry(lp, tid):
            return [lp, tid, tok.decode([tid]) if with_text else None]

        start = opts["logprob_start_len"]
        in_ids = job.input_ids[start:] if start >= 0 else []
        if job.images:  # SGLang holds image positions as hash sentinels and reports their ids as 0
            pad = state.lm.vision.image_pad_id
            in_ids = [0 if t == pad else t for t in in_ids]
        meta["input_token_logprobs"] = [entry(lp, tid) for lp, tid in zip(snap.input_logprobs, in_ids)]
        meta["output_token_logprobs"] = [entry(lp, tid) for lp, tid in zip(snap.output_logprobs, snap.output_ids)]
        if opts["top_logprobs_num"]:
            meta["input_top_logprobs"] = [None if t is None else [entry(lp, tid) for tid, lp in t] for t in snap.input_top]
            meta["output_top_logprobs"] = [[entry(lp, tid) for tid, lp in t] for t in snap.output_top]
    return {"text": text, "output_ids": snap.output_ids, "meta_info": meta}


def make_router(state: EngineState) -> APIRouter:
    r = APIRouter()

    @r.post("/generate")
    async def generate(request: Request):
        t0 = time.monotonic()
        try:
            body = await read_json(request)
            if body.get("image_data") and state.images is not None:  # decode + process off the event loop
                await asyncio.to_thread(state.images.prefetch, body["image_data"])
            job, opts = parse_generate(body, state)
            watch = await state.admit(job, request)
        except BadRequest as e:
            return error_response(str(e), e.status)
        except ClientGone:
            return Response(status_code=499)
        if opts["stream"]:

            async def frames():
                sent = 0
                try:
                    async for snap in watch.updates():
                        if len(snap.output_ids) == sent and snap.finish is None:
                            continue  # SGLang sends a frame per new token, not for admission
                        sent = len(snap.output_ids)
                        yield sse(build_response(state, job, snap, opts, t0))
                    yield SSE_DONE
                finally:
                    state.abort_if_running(job)
                    state.release(job)

            return StreamingResponse(frames(), media_type="text/event-stream")
        try:
            snap = await watch.result(request)
        except ClientGone:
            state.abort_if_running(job)
            return Response(status_code=499)
        finally:
            state.release(job)
        return json_response(build_response(state, job, snap, opts, t0))

    @r.post("/abort_request")
    async def abort_request(request: Request):
        try:
            body = await read_json(request)
        except BadRequest as e:
            return error_response(str(e), e.status)
        if body.get("abort_all"):
            state.worker.abort(None)
        elif body.get("rid"):
            state.worker.abort(str(body["rid"]))
        return Response(status_code=200)

    @r.post("/pause_generation")
    async def pause_generation(request: Request):
        try:
            body = await read_json(request)
        except BadRequest as e:
            return error_response(str(e), e.status)
        mode = body.get("mode") or "abort"
        if mode not in ("abort", "retract", "in_place"):
            return error_response(f"mode must be one of 'abort', 'retract', 'in_place', got {mode!r}")
        await state.pause("abort" if mode == "abort" else "in_place")
        return json_response({"message": "Generation paused successfully.", "status": "ok"})

    @r.post("/continue_generation")
    async def continue_generation(request: Request):
        await state.resume()
        return json_response({"message": "Generation continued successfully.", "status": "ok"})

    @r.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        try:
            body = await read_json(request)
        except BadRequest as e:
            return json_response({"success": False, "message": str(e)}, 400)
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            return json_response({"success": False, "message": "model_path is required"}, 400)
        version = body.get("weight_version")
        fut = state.worker.update_weights(path, None if version is None else str(version), abort_all=bool(body.get("abort_all_requests")))
        ok, message = await asyncio.wrap_future(fut)
        return json_response({"success": ok, "message": message, "num_paused_requests": 0}, 200 if ok else 400)

    @r.get("/model_info")
    @r.get("/get_model_info")
    async def model_info():
        cfg = state.lm.config
        return json_response(
            {
                "model_path": state.worker.model_path,
                "tokenizer_path": state.tokenizer_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": state.worker.weight_version,
                # debug: how many times weights were loaded, and the version each load named
                "weight_loads": state.worker.weight_loads,
                "weight_load_versions": list(state.worker.weight_load_versions),
                # weight-update groups joined (/init_weights_update_group) and tensor loads received
                "weight_update_groups": state.weight_groups.names() if state.weight_groups is not None else [],
                "weight_update_groups_joined": state.weight_groups.joined if state.weight_groups is not None else 0,
                "weight_update_groups_joining": state.weight_groups.joining if state.weight_groups is not None else 0,
                "tensor_updates": state.worker.tensor_updates,
                "has_image_understanding": state.lm.vision is not None,
                "has_audio_understanding": False,
                "model_type": getattr(cfg, "model_type", None),
                "architectures": getattr(cfg, "architectures", None),
            }
        )

    @r.get("/get_server_info")
    @r.get("/server_info")
    async def server_info():
        return json_response(
            {
                "version": "splice-reference",
                "model_path": state.worker.model_path,
                "served_model_name": state.served_model_name,
                "weight_version": state.worker.weight_version,
                "weight_loads": state.worker.weight_loads,
                "context_length": state.lm.context_len,
                "script_mode": state.script_mode,
                "script_counter": state.worker.script.counter if state.worker.script is not None else None,
                "paused": state.paused,
                "prefix_cache": state.worker.prefix.stats() if state.worker.prefix is not None else None,
                **state.worker.load(),
            }
        )

    @r.get("/health")
    @r.get("/health_generate")
    async def health():
        return Response(status_code=200)

    @r.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        return Response("Cache flushed.\n", status_code=200)

    return r
