"""Zero-latency engine stand-in for ``splice bench overhead``: ``python standin.py PORT SPEC.json``.

Runs in its own process so its CPU is never charged to the proxies being measured. It answers
instantly with fixed replies, so every millisecond above it is the proxy's or the client's:

* SGLang ``POST /generate``: fixed output ids and logprobs (an assistant turn with a ``<think>``
  block and one tool call, closed by ``<|im_end|>``), as Splice expects from a real SGLang.
* OpenAI ``POST /v1/chat/completions`` (non-streaming): a fixed assistant message with one tool
  call and a ``usage`` block, the baseline for chat-shaped traffic and the upstream for LiteLLM.

Plain ASGI (no framework) and pre-encoded bodies keep its own per-request cost as small as possible,
and a long prompt's ids are counted rather than parsed (``parse_generate``), so that the stand-in,
sharing the machine's caches with the proxy, does not slow the proxy down by its own churn.
Only needs uvicorn and orjson, so it does not import the project.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import time

import orjson
import uvicorn


# A ``/generate`` body longer than this has its prompt ids counted, not parsed (``parse_generate``).
COUNT_IDS_ABOVE = 64 << 10
_IDS_KEY = b'"input_ids":['


def parse_generate(body: bytes) -> tuple[dict, int]:
    """A ``/generate`` request and how many prompt ids it carries. A long prompt's ids are counted
    in its bytes, not parsed, unless the request asks for their logprobs: parsing a 100k-token
    prompt makes 100k Python ints (about 4 MB of heap made and freed per turn), and on a machine
    the stand-in shares with the proxy that churn pushed the proxy's own objects out of the shared
    cache, so the long-session rows measured the stand-in as much as the proxy. (The request key
    cannot occur inside a JSON string: a quote there is escaped.)"""
    i = body.find(_IDS_KEY) if len(body) > COUNT_IDS_ABOVE else -1
    if i >= 0:
        head = i + len(_IDS_KEY)
        end = body.find(b"]", head)
        if end >= 0:
            req = orjson.loads(body[:head] + body[end:])  # the same request with ``"input_ids":[]``
            if int(req.get("logprob_start_len", -1)) < 0:
                return req, (body.count(b",", head, end) + 1 if end > head else 0)
    req = orjson.loads(body)
    ids = req.get("input_ids") or []
    return req, len(ids)


def make_app(spec: dict):
    out_ids = spec["out_ids"]
    stop_id = spec["stop_id"]
    triples = [[-0.5, t, None] for t in out_ids]
    n_out = len(out_ids)
    call = spec["tool_call"]  # {"name": ..., "arguments": "<json string>"}
    reasoning = spec.get("reasoning", "")
    counter = itertools.count()
    state = {"version": "0"}  # the weight version, set by /update_weights_from_disk
    # What R2 costs the engine (``splice bench recompute`` reads GET /stats): prefill-only calls,
    # the tokens they sent, and turns that asked for input logprobs of their prompt.
    stats = {"prefill_calls": 0, "prefill_tokens": 0, "turns": 0, "turns_with_input_logprobs": 0, "input_logprob_tokens": 0}
    prefill_tok_s = float(spec.get("prefill_tok_per_s") or 0)  # >0: a prefill-only call takes len/rate seconds
    info = orjson.dumps({"model_path": "/standin", "is_generation": True, "weight_version": "0"})
    # SGLang's server arguments carry the context length (262,144: room for long-session phases)
    server_info = orjson.dumps({"context_length": int(spec.get("context_length", 262_144)), "tp_size": 1})
    models = orjson.dumps({"object": "list", "data": [{"id": "standin", "object": "model", "owned_by": "bench"}]})
    ok = orjson.dumps({"success": True})

    def generate(body: bytes) -> tuple[bytes, float]:
        req, n_ids = parse_generate(body)
        start = int(req.get("logprob_start_len", -1))
        # a prefill (R2 recompute) asks for input logprobs and no output
        inputs = [[None if j == 0 else -0.5, t, None] for j, t in enumerate((req.get("input_ids") or [])[start:])] if start >= 0 else []
        prefill = (req.get("sampling_params") or {}).get("max_new_tokens") == 0
        if prefill:
            stats["prefill_calls"] += 1
            stats["prefill_tokens"] += n_ids
        else:
            stats["turns"] += 1
            if start >= 0:
                stats["turns_with_input_logprobs"] += 1
                stats["input_logprob_tokens"] += n_ids - start
        # Images (SGLang's form: one pad per image plus ``image_data``) expand to ``image_tokens`` pads
        # each, as SGLang's processor does; the bench sends same-size screenshots.
        prompt_tokens = n_ids + len(req.get("image_data") or []) * (int(spec.get("image_tokens") or 1) - 1)
        meta = {
            "id": req.get("rid", "r"), "finish_reason": {"type": "length" if prefill else "stop", "matched": None if prefill else stop_id},
            "prompt_tokens": prompt_tokens, "completion_tokens": 0 if prefill else n_out, "cached_tokens": 0,
            "weight_version": state["version"], "input_token_logprobs": inputs, "output_token_logprobs": [] if prefill else triples, "e2e_latency": 0.0,
        }
        prefill_s = n_ids / prefill_tok_s if prefill and prefill_tok_s > 0 else 0.0
        return orjson.dumps({"text": "", "output_ids": [] if prefill else out_ids, "meta_info": meta}), prefill_s

    def chat(body: bytes) -> bytes:
        # Not parsed: a zero-latency engine. Prompt tokens are estimated from the body size.
        n = next(counter)
        prompt_tokens = len(body) // 4
        msg = {"role": "assistant", "content": None, "reasoning_content": reasoning,
               "tool_calls": [{"id": f"call_{n}", "type": "function", "function": call}]}
        return orjson.dumps({
            "id": f"chatcmpl-{n}", "object": "chat.completion", "created": int(time.time()), "model": "standin",
            "choices": [{"index": 0, "message": msg, "logprobs": None, "finish_reason": "tool_calls"}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n_out, "total_tokens": prompt_tokens + n_out},
        })

    _POST_ONLY = {"/generate", "/pause_generation", "/continue_generation", "/update_weights_from_disk", "/abort_request"}

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                m = await receive()
                if m["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif m["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        path = scope["path"]
        status = 200
        if scope["method"] == "GET" and path in _POST_ONLY:  # how engine facts tell a route exists
            data, status = b'{"detail": "Method Not Allowed"}', 405
        elif path == "/generate":
            data, prefill_s = generate(body)
            if prefill_s > 0:
                await asyncio.sleep(prefill_s)
        elif path == "/stats":
            data = orjson.dumps(stats)
        elif path in ("/v1/chat/completions", "/chat/completions"):
            data = chat(body)
        elif path in ("/model_info", "/get_model_info"):
            data = orjson.dumps({**orjson.loads(info), "weight_version": state["version"]})
        elif path == "/update_weights_from_disk":
            state["version"] = str(orjson.loads(body).get("weight_version", state["version"]))
            data = ok
        elif path in ("/v1/models", "/models"):
            data = models
        elif path in ("/server_info", "/get_server_info"):
            data = server_info
        else:
            data = ok
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})

    return app


if __name__ == "__main__":
    port = int(sys.argv[1])
    with open(sys.argv[2], "rb") as f:
        spec = orjson.loads(f.read())
    uvicorn.run(make_app(spec), host="127.0.0.1", port=port, log_level="warning", access_log=False, backlog=4096)
