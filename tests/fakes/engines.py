"""respx fakes shaped exactly like SGLang's and vLLM's HTTP replies (docs/design.md section 9).

Replies carry the real quirks: SGLang's ``[lp, id, null]`` triples, the null first input
logprob, ``finish_reason`` dicts, string ``weight_version``, empty output for a request aborted
in the queue; vLLM's ``"token_id:N"`` strings, echoed prompt with a null first logprob,
``-9999.0`` for -inf, ``finish_reason`` "abort".

``FakeSGLang`` / ``FakeVLLM`` play a scripted engine: each ``/generate`` call consumes one
``Step``; input (prompt) logprobs come from ``prefill_lp(version, position, token)`` under the
fake's *current* weight version, so a value placed at the wrong position or version shows.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import httpx
import respx

from engines.types import EngineInfo, Generation


def default_lp(version: int, pos: int, token: int) -> float:
    """Distinct per (version, position): a misplaced value is visible."""
    return -round(0.5 + version + pos / 100.0, 6)


@dataclass
class Step:
    """One engine call's scripted outcome: tokens (id, behaviour logprob) and how it ends."""

    tokens: list[tuple[int, float]] = field(default_factory=list)
    finish: str = "stop"  # stop | length | abort
    matched: int | str | None = None
    status: int = 200  # non-200: reply with an error instead
    raw: bytes | None = None  # reply with exactly these bytes (malformed-JSON tests)
    spans: list[dict] | None = None  # SGLang >= 0.5.23 meta_info.weight_versions


# -- SGLang --------------------------------------------------------------------------------------


def sglang_finish(step: Step, n: int) -> dict:
    if step.finish == "stop":
        return {"type": "stop", "matched": step.matched}
    if step.finish == "length":
        return {"type": "length", "length": n}
    msg = "Abort in waiting queue" if n == 0 else "Abort request by pause_generation"
    return {"type": "abort", "message": msg, "status_code": 200}


def sglang_reply(
    input_ids: list[int],
    step: Step,
    *,
    logprob_start_len: int = -1,
    prefill: Callable[[int], float | None] = lambda pos: -1.0,
    weight_version: str = "default",
    cached: int = 0,
    rid: str = "rid",
    upto: int | None = None,
    final: bool = True,
) -> dict:
    """The JSON body SGLang's ``/generate`` returns (or one cumulative stream frame)."""
    toks = step.tokens if upto is None else step.tokens[:upto]
    if logprob_start_len < 0 or (step.finish == "abort" and not step.tokens):
        inputs: list = []
    else:
        inputs = [
            [None if j == 0 else prefill(pos), input_ids[pos], None]
            for j, pos in enumerate(range(logprob_start_len, len(input_ids)))
        ]
    return {
        "text": "".join(f"<{t}>" for t, _ in toks),
        "output_ids": [t for t, _ in toks],
        "meta_info": {
            "id": rid,
            "finish_reason": sglang_finish(step, len(toks)) if final else None,
            "prompt_tokens": len(input_ids),
            "weight_version": weight_version,
            "total_retractions": 0,
            "completion_tokens": len(toks),
            "cached_tokens": cached,
            "input_token_logprobs": inputs,
            "output_token_logprobs": [[lp, t, None] for t, lp in toks],
            "e2e_latency": 0.01,
            **({"weight_versions": step.spans} if step.spans is not None else {}),
        },
    }


def sse(frames: list[dict]) -> bytes:
    return b"".join(b"data: " + json.dumps(f).encode() + b"\n\n" for f in frames) + b"data: [DONE]\n\n"


METHOD_NOT_ALLOWED = httpx.Response(405, json={"detail": "Method Not Allowed"})
NOT_FOUND = httpx.Response(404, json={"detail": "Not Found"})


def model_card(served: str, root: str, max_model_len: int | None, owned_by: str) -> dict:
    """One ``/v1/models`` entry as vLLM's and SGLang's ``ModelCard`` serialise it."""
    return {
        "id": served,
        "object": "model",
        "created": 1700000000,
        "owned_by": owned_by,
        "root": root,
        "parent": None,
        "max_model_len": max_model_len,
        "permission": [],
    }


class FakeSGLang:
    """A scripted SGLang replica on a respx router."""

    def __init__(
        self,
        router: respx.MockRouter,
        url: str,
        *,
        version: str = "0",
        context_length: int | None = 32768,
        model_path: str = "/models/Qwen3-8B",
        served_model: str = "Qwen/Qwen3-8B",
    ):
        self.url = url.rstrip("/")
        self.version = version
        self.context_length = context_length
        self.model_path = model_path
        self.served_model = served_model
        self.pause_status = 200
        self.script: list[Step] = []
        self.requests: list[dict] = []
        self.headers: list[httpx.Headers] = []
        self.admin: list[tuple[str, dict | None]] = []
        self.prefill_lp: Callable[[int, int, int], float] = default_lp
        self.on_abort: Callable[[], Awaitable[None]] | None = None
        self.cached = 0
        self.update_ok = True
        self.generate_route = router.post(f"{self.url}/generate").mock(side_effect=self._generate)
        router.post(f"{self.url}/pause_generation").mock(side_effect=self._admin)
        router.post(f"{self.url}/continue_generation").mock(side_effect=self._admin)
        router.post(f"{self.url}/update_weights_from_disk").mock(side_effect=self._update)
        router.post(f"{self.url}/abort_request").mock(side_effect=self._admin)
        router.get(f"{self.url}/model_info").mock(side_effect=self._model_info)
        router.get(f"{self.url}/health").mock(return_value=httpx.Response(200))
        router.get(f"{self.url}/v1/models").mock(side_effect=self._models)
        router.get(f"{self.url}/server_info").mock(side_effect=self._server_info)
        for path in ("/pause_generation", "/continue_generation", "/update_weights_from_disk"):
            router.get(f"{self.url}{path}").mock(return_value=METHOD_NOT_ALLOWED)

    async def _models(self, request: httpx.Request) -> httpx.Response:
        # SGLang's card: root is the served name, max_model_len the resolved context length.
        card = model_card(self.served_model, self.served_model, self.context_length, "sglang")
        return httpx.Response(200, json={"object": "list", "data": [card]})

    async def _server_info(self, request: httpx.Request) -> httpx.Response:
        # server_args fields: context_length is the --context-length argument (None when unset).
        return httpx.Response(
            200,
            json={"model_path": self.model_path, "context_length": None, "tp_size": 1, "version": "0.5.23", "internal_states": [{}]},
        )

    @property
    def int_version(self) -> int:
        return int(self.version) if self.version.isdigit() else 0

    async def _admin(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.admin.append((request.url.path, body))
        if request.url.path == "/pause_generation" and self.pause_status != 200:
            return httpx.Response(self.pause_status, json={"error": {"message": "pause failed: scheduler busy"}})
        return httpx.Response(200, json={"success": True} if request.url.path != "/pause_generation" else None)

    async def _update(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.admin.append((request.url.path, body))
        if not self.update_ok:
            return httpx.Response(200, json={"success": False, "message": "Failed to load weights: no such file"})
        self.version = body["weight_version"]
        return httpx.Response(200, json={"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0})

    async def _model_info(self, request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            200,
            json={
                "model_path": self.model_path,
                "served_model_name": self.served_model,
                "tokenizer_path": self.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.version,
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "qwen3",
                "architectures": ["Qwen3ForCausalLM"],
            },
        )

    async def _generate(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.requests.append(body)
        self.headers.append(request.headers)
        step = self.script.pop(0)
        if step.raw is not None:
            return httpx.Response(step.status, content=step.raw)
        if step.status != 200:
            return httpx.Response(step.status, json={"error": {"message": "boom", "code": step.status}})
        ids = body["input_ids"]
        version = self.int_version

        def prefill(pos: int) -> float:
            return self.prefill_lp(version, pos, ids[pos])

        kw = dict(
            logprob_start_len=body["logprob_start_len"],
            prefill=prefill,
            weight_version=self.version,
            cached=self.cached,
            rid=body["rid"],
        )
        if step.finish == "abort" and self.on_abort is not None:
            await self.on_abort()
        if not body["stream"]:
            return httpx.Response(200, json=sglang_reply(ids, step, **kw))
        frames = [sglang_reply(ids, step, upto=k, final=False, **kw) for k in range(1, len(step.tokens))]
        frames.append(sglang_reply(ids, step, **kw))
        return httpx.Response(200, content=sse(frames), headers={"content-type": "text/event-stream"})


# -- vLLM ----------------------------------------------------------------------------------------


def vllm_reply(
    input_ids: list[int],
    step: Step,
    *,
    echo: bool = False,
    prefill: Callable[[int], float] = lambda pos: -1.0,
    stop_reason: int | str | None = None,
    cached: int | None = None,
) -> dict:
    """The JSON body vLLM's ``/v1/completions`` returns with ``logprobs: 0`` and token ids."""
    out_ids = [t for t, _ in step.tokens]
    tokens = [f"token_id:{t}" for t in out_ids]
    lps: list[float | None] = [lp for _, lp in step.tokens]
    if echo:
        tokens = [f"token_id:{t}" for t in input_ids] + tokens
        lps = [None] + [prefill(p) for p in range(1, len(input_ids))] + lps
    return {
        "id": "cmpl-0123",
        "object": "text_completion",
        "created": 1700000000,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "text": "".join(f"<{t}>" for t in out_ids),
                "logprobs": {
                    "text_offset": list(range(len(tokens))),
                    "token_logprobs": lps,
                    "tokens": tokens,
                    "top_logprobs": [None if v is None else {tok: v} for tok, v in zip(tokens, lps)],
                },
                "finish_reason": step.finish,
                "stop_reason": stop_reason if stop_reason is not None else step.matched,
                "prompt_logprobs": None,
                "prompt_token_ids": list(input_ids),
                "token_ids": out_ids,
            }
        ],
        "usage": {
            "prompt_tokens": len(input_ids),
            "total_tokens": len(input_ids) + len(out_ids),
            "completion_tokens": len(out_ids),
            "prompt_tokens_details": None if cached is None else {"cached_tokens": cached},
        },
    }


def vllm_stream(input_ids: list[int], step: Step, *, echo: bool, prefill: Callable[[int], float]) -> bytes:
    """vLLM's SSE: with echo the first chunk carries the prompt plus the first output token."""
    frames = []
    for k, (t, lp) in enumerate(step.tokens or [(None, None)]):
        last = k == max(len(step.tokens) - 1, 0)
        toks: list[str] = []
        lps: list[float | None] = []
        if echo and k == 0:
            toks = [f"token_id:{x}" for x in input_ids]
            lps = [None] + [prefill(p) for p in range(1, len(input_ids))]
        if t is not None:
            toks.append(f"token_id:{t}")
            lps.append(lp)
        frames.append(
            {
                "id": "cmpl-1",
                "object": "text_completion",
                "created": 0,
                "model": "tiny",
                "choices": [
                    {
                        "index": 0,
                        "text": "x",
                        "logprobs": {"text_offset": [0] * len(toks), "token_logprobs": lps, "tokens": toks, "top_logprobs": None},
                        "finish_reason": step.finish if last else None,
                        "stop_reason": step.matched if last else None,
                        "prompt_token_ids": list(input_ids) if k == 0 else None,
                        "token_ids": [] if t is None else [t],
                    }
                ],
            }
        )
    frames.append(
        {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 0,
            "model": "tiny",
            "choices": [],
            "usage": {"prompt_tokens": len(input_ids), "completion_tokens": len(step.tokens), "total_tokens": 0},
        }
    )
    return sse(frames)


class FakeVLLM:
    """A scripted vLLM replica on a respx router. Completions report no weight version: the test
    sets ``version`` to the weights it pretends to have. With ``dev_mode`` (``VLLM_SERVER_DEV_MODE=1``)
    it has vLLM 0.32's control routes: ``/pause``, ``/resume``, ``/is_paused``, ``/collective_rpc``,
    ``/update_weight_version``, ``/weight_info``, ``/server_info``; without it they are 404."""

    def __init__(
        self,
        router: respx.MockRouter,
        url: str,
        *,
        version: int = 0,
        dev_mode: bool = True,
        max_model_len: int | None = 4096,
        root: str = "/models/tiny",
        served: str = "tiny",
        tied: bool | None = False,
    ):
        self.url = url.rstrip("/")
        self.version = version
        self.script: list[Step] = []
        self.requests: list[dict] = []
        self.admin: list[str] = []
        self.rpc: list[dict] = []
        self.prefill_lp: Callable[[int, int, int], float] = default_lp
        self.on_abort: Callable[[], Awaitable[None]] | None = None
        self.weight_version = "default"  # vLLM's EngineCore starts with "default"
        self.root = root
        self.tied = tied
        self.reload_error: str | None = None  # reply 500 with this message to reload_weights
        self.pause_status = 200
        self.keep_version = False  # acknowledge /update_weight_version but keep the old one
        router.post(f"{self.url}/v1/completions").mock(side_effect=self._complete)
        router.get(f"{self.url}/health").mock(return_value=httpx.Response(200))
        router.get(f"{self.url}/v1/models").mock(
            return_value=httpx.Response(
                200, json={"object": "list", "data": [model_card(served, root, max_model_len, "vllm")]}
            )
        )
        dev = {
            ("POST", "/pause"): self._pause,
            ("POST", "/resume"): self._admin,
            ("POST", "/collective_rpc"): self._collective_rpc,
            ("POST", "/update_weight_version"): self._update_weight_version,
            ("GET", "/weight_info"): self._weight_info,
            ("GET", "/is_paused"): lambda r: httpx.Response(200, json={"is_paused": False}),
            ("GET", "/server_info"): self._server_info,
        }
        for (method, path), handler in dev.items():
            route = router.route(method=method, url__regex=rf"^{self.url}{path}(\?.*)?$")
            route.mock(side_effect=handler if dev_mode else (lambda r: NOT_FOUND))
            if method == "POST":
                router.get(f"{self.url}{path}").mock(return_value=METHOD_NOT_ALLOWED if dev_mode else NOT_FOUND)

    async def _admin(self, request: httpx.Request) -> httpx.Response:
        self.admin.append(str(request.url.copy_with(scheme="http", host="h", port=None)).replace("http://h", ""))
        path = request.url.path
        return httpx.Response(200, json={"status": "paused" if path == "/pause" else "resumed"})

    async def _pause(self, request: httpx.Request) -> httpx.Response:
        if self.pause_status != 200:
            self.admin.append("/pause FAILED")
            return httpx.Response(self.pause_status, json={"error": "Failed to pause generation: engine dead"})
        return await self._admin(request)

    async def _collective_rpc(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.rpc.append(body)
        if body.get("method") != "reload_weights":
            return httpx.Response(200, json={"results": [None]})
        if self.reload_error is not None:
            # an exception in the worker surfaces as FastAPI's 500
            return httpx.Response(500, content=b"Internal Server Error")
        return httpx.Response(200, json={"results": [None]})

    async def _update_weight_version(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.admin.append(f"/update_weight_version {body}")
        if self.keep_version:
            return httpx.Response(200, json={"success": True, "new_version": body["new_version"]})
        self.weight_version = body["new_version"]
        if str(self.weight_version).isdigit():
            self.version = int(self.weight_version)
        return httpx.Response(200, json={"success": True, "new_version": body["new_version"]})

    async def _weight_info(self, request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"weight_version": self.weight_version})

    async def _server_info(self, request: httpx.Request) -> httpx.Response:
        hf = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
        if self.tied is not None:
            hf["tie_word_embeddings"] = self.tied
        return httpx.Response(
            200, json={"vllm_config": {"model_config": {"model": self.root, "hf_config": hf}}, "vllm_env": {}, "system_env": {}}
        )

    async def _complete(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.requests.append(body)
        step = self.script.pop(0)
        if step.status != 200:
            return httpx.Response(step.status, json={"object": "error", "message": "boom", "code": step.status})
        ids = body["prompt"]
        version = self.version
        echo = bool(body.get("echo"))

        def prefill(pos: int) -> float:
            return self.prefill_lp(version, pos, ids[pos])

        if step.finish == "abort" and self.on_abort is not None:
            await self.on_abort()
        if body["stream"]:
            return httpx.Response(200, content=vllm_stream(ids, step, echo=echo, prefill=prefill))
        return httpx.Response(200, json=vllm_reply(ids, step, echo=echo, prefill=prefill))


async def until(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait (polling the event loop) until ``cond()`` holds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.001)


class FixedPool:
    """An engine pool that answers every turn with the same sampled ids (no model)."""

    def __init__(self, ids: list[int]):
        self.ids = ids
        self.version = 0
        self.paused = False
        self.info = EngineInfo()  # an engine that says nothing about itself

    async def start(self):
        pass

    async def close(self):
        pass

    async def generate(self, input_ids, params, *, session_id, on_tokens=None):
        ids = self.ids[: params.max_new_tokens]
        if on_tokens is not None:
            await on_tokens(ids, [-0.5] * len(ids))
        n = len(ids)
        return Generation(output_ids=list(ids), logprobs=[-0.5] * n, versions=[0] * n, proximal_logprobs_t=[-0.5] * n,
                          proximal_versions=[0] * n, finish_reason="stop" if n == len(self.ids) else "length",
                          prompt_tokens=len(input_ids))

    async def prefill_logprobs(self, input_ids, start, *, session_id):
        return [-0.5] * (len(input_ids) - start)

    # the admin surface, as the weight-update routes use it
    async def pause(self):
        self.paused = True

    async def resume(self):
        self.paused = False

    async def update_weights(self, model_path, version, **_kw):
        self.version = int(version)
        return {}

    def set_version(self, version, **_kw):
        self.version = int(version)

    async def announce_version(self, version, **_kw):
        self.set_version(version)

    def status(self):
        return {"in_flight": 0}

    # the weight-transfer surface of a pool with no engine ids: every named engine is unknown
    def _unknown(self, engine: str):
        raise ValueError(f"unknown engine {engine!r}; this proxy's engines are []")

    async def weight_ranks(self, engine: str) -> int:
        self._unknown(engine)

    async def init_weights_group(self, engine: str, group) -> None:
        self._unknown(engine)

    async def destroy_weights_group(self, engine: str, group_name: str) -> None:
        self._unknown(engine)

    def begin_transfer(self, engines: list[str], version: int) -> list[str]:
        return []

    async def update_weights_from_distributed(self, engine: str, batch) -> None:
        self._unknown(engine)

    def commit_transfer(self, version: int, updated: list[str], failed: dict[str, str]) -> None:
        pass  # engines it does not have are ignored, as EnginePool ignores them
