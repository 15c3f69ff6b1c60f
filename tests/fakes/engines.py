"""respx fakes shaped exactly like SGLang's and vLLM's HTTP replies (docs/design.md section 9).

Replies carry the real quirks: SGLang's ``[lp, id, null]`` triples, the null first input
logprob, ``finish_reason`` dicts, string ``weight_version``, empty output for a request aborted
in the queue; vLLM's ``"token_id:N"`` strings, echoed prompt with a null first logprob,
``-9999.0`` for -inf, ``finish_reason`` "abort".

``FakeSGLang`` / ``FakeVLLM`` play a scripted engine: each ``/generate`` call consumes one
``Step``; input (prompt) logprobs come from ``prefill_lp(version, position, token)`` under the
fake's *current* weight version, so a value placed at the wrong position or version shows.

Images follow the released servers' rules (docs/engines.md, "Images"): SGLang 0.5.23 decodes
the data URLs, crashes (HTTP 500) on more ``<|image_pad|>`` than images (pre-expanded runs:
its pinned transformers 5.19 processor runs out of replacements), refuses fewer, expands each
pad with the Qwen2-VL image processor's own ``smart_resize``, answers in expanded coordinates
and reports id 0 for image positions in ``input_token_logprobs``. vLLM 0.32's ``/inference/v1/generate``
validates like its pydantic model and replaces the first pad per image, as its prompt update
does (so a pre-expanded run silently keeps its extra pads).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import json
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import httpx
import respx

from engines.types import EngineInfo, Generation


IMAGE_PAD_ID = 151655  # <|image_pad|> in the Qwen2-VL / Qwen2.5-VL vocabulary
VOCAB_SIZE = 151936  # the Qwen2.5-VL / Qwen3 config's vocab_size (the LM head's rows)
MIN_PIXELS = 4 * 28 * 28  # the tiny vision model's preprocessor_config.json
MAX_PIXELS = 256 * 28 * 28


class ImageLoadError(ValueError):
    pass


def image_tokens(url: str, *, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS) -> int:
    """How many ``<|image_pad|>`` one data-URL image expands to, by the Qwen2-VL image
    processor's own ``smart_resize`` (patch 14, merge 2): what both engines compute."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    if not isinstance(url, str) or not url.startswith("data:") or ";base64," not in url:
        raise ImageLoadError(f"Invalid image: {str(url)[:40]!r}")
    try:
        raw = base64.b64decode(url.split(";base64,", 1)[1], validate=True)
        with Image.open(io.BytesIO(raw)) as im:
            im.load()
            width, height = im.size
    except (binascii.Error, OSError, ValueError) as exc:
        raise ImageLoadError(f"cannot identify image file: {exc}") from None
    h, w = smart_resize(height, width, factor=28, min_pixels=min_pixels, max_pixels=max_pixels)
    return (h // 14) * (w // 14) // 4


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
    image_positions: frozenset[int] = frozenset(),
) -> dict:
    """The JSON body SGLang's ``/generate`` returns (or one cumulative stream frame).
    ``input_ids`` are the expanded prompt; at ``image_positions`` the engine's ids are the
    per-image pad sentinels, which its logprob output clips to 0."""
    toks = step.tokens if upto is None else step.tokens[:upto]
    if logprob_start_len < 0 or (step.finish == "abort" and not step.tokens):
        inputs: list = []
    else:
        inputs = [
            [None if j == 0 else prefill(pos), 0 if pos in image_positions else input_ids[pos], None]
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


# sglang/api/v1/api_types.py _FIELDS_SamplingParams: the keys /generate accepts (others: 400)
SGLANG_SAMPLING_KEYS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
)


def sglang_check(body: dict, vocab_size: int) -> str | None:
    """The 400 message SGLang 0.5.23 gives a ``/generate`` body before any image work: the
    JSON contract (unknown sampling keys) and ``SamplingParams.verify`` (logit_bias keys)."""
    sp = body.get("sampling_params") or {}
    for key in sp:
        if key not in SGLANG_SAMPLING_KEYS:
            return f"unknown field `{key}`, expected one of " + ", ".join(f"`{k}`" for k in SGLANG_SAMPLING_KEYS)
    bias = sp.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict) or not all(isinstance(v, (int, float)) for v in bias.values()):
            return "invalid type: expected a map of f64"
    image_data = body.get("image_data")
    if image_data is not None and not (isinstance(image_data, list) and all(isinstance(u, str) for u in image_data)):
        return "invalid type: expected one of the MediaItem shapes"
    return None


def sglang_verify(body: dict, vocab_size: int) -> str | None:
    """``SamplingParams.verify`` (sglang/srt/sampling/sampling_params.py): a ValueError, which
    the HTTP server answers as 400 ``{"error": {"message": ...}}``."""
    for key in (body.get("sampling_params") or {}).get("logit_bias") or {}:
        try:
            ok = 0 <= int(key) < vocab_size
        except ValueError:
            return f"invalid literal for int() with base 10: {key!r}"
        if not ok:
            return f"logit_bias must has keys in [0, {vocab_size - 1}], got {key}."
    return None


class EngineCrash(Exception):
    """A non-ValueError inside SGLang's request handling: FastAPI answers 500."""


def sglang_expand(ids: list[int], urls: list[str], **pixels: int) -> tuple[list[int], frozenset[int]]:
    """SGLang's Qwen-VL path for ``input_ids`` + ``image_data``: load every image (a bad one is
    a ValueError, 400), run the HF processor on the decoded prompt, then expand each single pad
    in place (``SGLANG_MM_AVOID_RETOKENIZE``: the caller's ids verbatim).

    More pads than images (a pre-expanded run) makes transformers 5.19's
    ``get_text_with_replacements`` call ``next()`` on an exhausted iterator: StopIteration, not
    a ValueError, so the server answers 500 (``EngineCrash``). Fewer pads than images fails
    ``_expand_input_ids``' count check, which the server only logs before re-tokenizing; the
    stand-in refuses it (400) rather than guess what follows."""
    counts = []
    for k, url in enumerate(urls):
        try:
            counts.append(image_tokens(url, **pixels))
        except ImageLoadError as exc:
            raise ValueError(f"An exception occurred while loading IMAGE data at index {k}: {exc}") from None
    found = sum(1 for t in ids if t == IMAGE_PAD_ID)
    if found > len(urls):
        raise EngineCrash(f"StopIteration: {found} <|image_pad|> in the prompt, {len(urls)} image replacements")
    if found < len(urls):
        raise ValueError(f"prompt has {found} image placeholder token(s) but {len(urls)} image(s) were provided")
    out: list[int] = []
    positions: set[int] = set()
    k = 0
    for t in ids:
        if t == IMAGE_PAD_ID:
            positions.update(range(len(out), len(out) + counts[k]))
            out.extend([IMAGE_PAD_ID] * counts[k])
            k += 1
        else:
            out.append(t)
    return out, frozenset(positions)


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
        self.vocab_size = VOCAB_SIZE
        self.pixels = {"min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS}  # its image processor's limits
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
        problem = sglang_check(body, self.vocab_size)
        if problem is not None:
            self.script.insert(0, step)  # a refused request consumed nothing
            return httpx.Response(400, json={"error": problem})
        problem = sglang_verify(body, self.vocab_size)
        if problem is not None:
            self.script.insert(0, step)
            return httpx.Response(400, json={"error": {"message": problem}})
        ids = body["input_ids"]
        positions: frozenset[int] = frozenset()
        if body.get("image_data"):
            try:
                ids, positions = sglang_expand(ids, body["image_data"], **self.pixels)
            except ValueError as exc:
                self.script.insert(0, step)
                return httpx.Response(400, json={"error": {"message": str(exc)}})
            except EngineCrash:
                self.script.insert(0, step)
                return httpx.Response(500, content=b"Internal Server Error", headers={"content-type": "text/plain"})
        banned = {int(k) for k, v in (body["sampling_params"].get("logit_bias") or {}).items() if v <= -100}
        if any(t in banned for t, _ in step.tokens):
            raise AssertionError(f"the script samples a banned id {sorted(banned)}: SGLang would not")
        version = self.int_version

        def prefill(pos: int) -> float:
            return self.prefill_lp(version, pos, ids[pos])

        kw = dict(
            logprob_start_len=body["logprob_start_len"],
            prefill=prefill,
            weight_version=self.version,
            cached=self.cached,
            rid=body["rid"],
            image_positions=positions,
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
        scale_out: bool = True,
        extension: bool = False,
    ):
        self.url = url.rstrip("/")
        self.extension = extension  # started with --worker-extension-cls engines.vllm_worker.SpliceWorkerExtension
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
        self.vocab_size = VOCAB_SIZE
        self.pixels = {"min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS}  # its image processor's limits
        self.scale_out = scale_out
        self.generate_requests: list[dict] = []
        router.post(f"{self.url}/v1/completions").mock(side_effect=self._complete)
        self.generate_route = router.post(f"{self.url}/inference/v1/generate").mock(side_effect=self._generate_tokens)
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
        method = body.get("method")
        extension_methods = {"splice_reload_weights", "splice_refresh_tied"}
        if method in extension_methods and not self.extension:
            # run_method's NotImplementedError in the worker surfaces as FastAPI's 500
            return httpx.Response(500, content=b"Internal Server Error")
        if method not in ("reload_weights", "splice_reload_weights"):
            return httpx.Response(200, json={"results": [{"refreshed": ["lm_head"]} if method in extension_methods else None]})
        if self.reload_error is not None:
            # an exception in the worker surfaces as FastAPI's 500
            return httpx.Response(500, content=b"Internal Server Error")
        return httpx.Response(200, json={"results": [{"refreshed": ["lm_head"] if self.tied else []} if self.extension else None]})

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
        parallel = {"worker_extension_cls": "engines.vllm_worker.SpliceWorkerExtension" if self.extension else ""}
        config = {"model_config": {"model": self.root, "hf_config": hf}, "parallel_config": parallel}
        return httpx.Response(200, json={"vllm_config": config, "vllm_env": {}, "system_env": {}})

    async def _generate_tokens(self, request: httpx.Request) -> httpx.Response:
        """``POST /inference/v1/generate`` (vLLM 0.32, ``--enable-scale-out``)."""
        if not self.scale_out:
            return httpx.Response(403, json=vllm_error(SCALE_OUT_DISABLED, "PermissionDeniedError", 403))
        body = json.loads(request.content)
        self.generate_requests.append(body)
        problem = vllm_generate_check(body, self.vocab_size)
        if problem is not None:
            return httpx.Response(400, json=problem)
        step = self.script.pop(0)
        if step.status != 200:
            return httpx.Response(step.status, json=vllm_error("boom", "InternalServerError", step.status))
        urls = [p.get("url") for p in body.get("content_parts") or [] if p.get("type") == "image_url"]
        try:
            ids, placeholders = vllm_expand(body["token_ids"], urls, **self.pixels)
        except PromptUpdateError as exc:
            self.script.insert(0, step)
            return httpx.Response(500, json=vllm_error(str(exc), "InternalServerError", 500))
        except ValueError as exc:
            self.script.insert(0, step)
            return httpx.Response(400, json=vllm_error(str(exc), "BadRequestError", 400))
        sp = body["sampling_params"]
        banned = {int(k) for k, v in (sp.get("logit_bias") or {}).items() if v <= -100}
        if any(t in banned for t, _ in step.tokens):
            raise AssertionError(f"the script samples a banned id {sorted(banned)}: vLLM would not")
        version = self.version
        prompt_lps = None
        if sp.get("prompt_logprobs") is not None:
            prompt_lps = [None] + [
                {str(ids[p]): {"logprob": self.prefill_lp(version, p, ids[p]), "rank": 1, "decoded_token": None}}
                for p in range(1, len(ids))
            ]
        if step.finish == "abort" and self.on_abort is not None:
            await self.on_abort()
        meta = {
            "prompt_token_ids": ids if body.get("return_token_ids") else None,
            "mm_placeholders": {"image": placeholders} if body.get("return_token_ids") and placeholders else None,
        }
        if body.get("stream"):
            return httpx.Response(200, content=vllm_generate_stream(ids, step, meta, self.weight_version))
        return httpx.Response(200, json=vllm_generate_reply(ids, step, meta, prompt_lps, self.weight_version))

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


SCALE_OUT_DISABLED = "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."


def vllm_error(message: str, kind: str, code: int) -> dict:
    """vLLM's ``ErrorResponse`` body."""
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def pydantic_error(kind: str, loc: str, msg: str, value) -> dict:
    """vLLM's answer to a request its pydantic model refuses (serve/exception_handling/
    handlers/validation.py): 400, type "Bad Request", the errors listed, ``param`` the field."""
    err = {"type": kind, "loc": loc, "msg": msg, "input": str(value)}
    return {"error": {"message": f"1 validation error:\n  {err}", "type": "Bad Request", "param": loc, "code": 400}}


def vllm_generate_check(body: dict, vocab_size: int) -> dict | None:
    """The 400 body vLLM 0.32 gives a ``/inference/v1/generate`` request its ``GenerateRequest``
    (pydantic, unknown keys ignored) or ``SamplingParams`` refuses (token_in_token_out/protocol.py,
    sampling_params.py), or None."""
    ids = body.get("token_ids")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        return pydantic_error("list_type", "body.token_ids", "Input should be a valid list of integers", ids)
    if len(ids) < 1:
        return pydantic_error("too_short", "body.token_ids", "List should have at least 1 item after validation, not 0", ids)
    if any(t < 0 for t in ids):
        return pydantic_error("value_error", "body.token_ids", "Value error, token_ids must not contain negative values", ids)
    sp = body.get("sampling_params")
    if not isinstance(sp, dict):
        return pydantic_error("missing", "body.sampling_params", "Field required", body)
    parts = body.get("content_parts")
    if parts is not None and not (isinstance(parts, list) and all(isinstance(p, dict) for p in parts)):
        return pydantic_error("dict_type", "body.content_parts", "Input should be a valid dictionary", parts)
    if body.get("content_parts") and body.get("features"):
        return pydantic_error("value_error", "body", "Value error, content_parts and features are mutually exclusive", "")
    bias = sp.get("logit_bias") or {}
    try:
        bad = [int(k) for k in bias if not 0 <= int(k) < vocab_size]
    except ValueError:
        return pydantic_error("int_parsing", "body.sampling_params.logit_bias", "Input should be a valid integer", bias)
    if bad:
        message = f"token_id(s) {bad} in logit_bias contain out-of-vocab token ids. Vocabulary size: {vocab_size}"
        return {"error": {"message": message, "type": "BadRequestError", "param": "logit_bias", "code": 400}}
    return None


class PromptUpdateError(RuntimeError):
    """vLLM's ``_validate_mm_updates``: a RuntimeError, answered 500 InternalServerError."""


def vllm_expand(ids: list[int], urls: list[str], **pixels: int) -> tuple[list[int], list[dict]]:
    """vLLM 0.32's prompt update for a Qwen-VL token prompt: the i-th ``<|image_pad|>`` (in
    order, searching after the previous replacement) becomes ``N_i`` pads; ids past the last
    replaced pad stay as they are (a pre-expanded run keeps its extra pads as text). An image
    that cannot be loaded is a ValueError (400); fewer pads than images a ``PromptUpdateError``."""
    counts = []
    for url in urls:
        try:
            counts.append(image_tokens(url, **pixels))
        except ImageLoadError as exc:
            raise ValueError(str(exc)) from None
    out: list[int] = []
    placeholders: list[dict] = []
    k = 0
    for t in ids:
        if t == IMAGE_PAD_ID and k < len(counts):
            placeholders.append({"offset": len(out), "length": counts[k]})
            out.extend([IMAGE_PAD_ID] * counts[k])
            k += 1
        else:
            out.append(t)
    if k != len(counts):
        raise PromptUpdateError(
            f"Expected there to be {len(counts)} prompt updates corresponding to {len(counts)} image items, "
            f"but instead found {k} prompt updates!"
        )
    return out, placeholders


def _content(t: int, lp: float) -> dict:
    """``GenerateLogProbsContent`` with ``logprobs: 0``: the sampled token heads its top list."""
    return {"token_id": t, "logprob": lp, "rank": 1, "top_logprobs": [{"token_id": t, "logprob": lp, "rank": 1}]}


def vllm_generate_reply(ids: list[int], step: Step, meta: dict, prompt_lps: list | None, weight_version: str) -> dict:
    """``GenerateTokensResponse`` as ``/inference/v1/generate`` returns it (non-streaming)."""
    out = [t for t, _ in step.tokens]
    return {
        "request_id": "generate-tokens-0123",
        "model": "tiny",
        "created": 1700000000,
        "usage": {"prompt_tokens": len(ids), "total_tokens": len(ids) + len(out), "completion_tokens": len(out),
                  "prompt_tokens_details": None},
        "prompt_logprobs": prompt_lps,
        "prompt_token_id_logprobs": None,
        "prompt_token_ids": meta["prompt_token_ids"],
        "mm_placeholders": meta["mm_placeholders"],
        "metrics": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "output_mode": "tokens",
        "choices": [
            {
                "index": 0,
                "finish_reason": step.finish,
                "stop_reason": step.matched,
                "token_ids": out,
                "routed_experts": None,
                "sampling_mask": None,
                "weight_versions": [{"version": weight_version, "start": 0, "end": len(out)}] if out else [],
                "logprobs": {"content": [_content(t, lp) for t, lp in step.tokens]},
            }
        ],
    }


def vllm_generate_stream(ids: list[int], step: Step, meta: dict, weight_version: str) -> bytes:
    """The SSE of ``/inference/v1/generate`` with ``stream_options.include_usage``: one chunk
    per token (the first also carries ``prompt_token_ids`` / ``mm_placeholders``), the finish
    and ``weight_versions`` on the last, then a usage chunk with no choices."""
    frames = []
    toks = step.tokens or [(None, None)]
    for k, (t, lp) in enumerate(toks):
        last = k == len(toks) - 1
        chunk = {
            "request_id": "generate-tokens-1",
            "usage": None,
            "output_mode": "tokens",
            "choices": [
                {
                    "index": 0,
                    "finish_reason": step.finish if last else None,
                    "stop_reason": step.matched if last else None,
                    "token_ids": [] if t is None else [t],
                    "routed_experts": None,
                    "sampling_mask": None,
                    "weight_versions": (
                        [{"version": weight_version, "start": 0, "end": len(step.tokens)}] if last and step.tokens else None
                    ),
                    "logprobs": {"content": [] if t is None else [_content(t, lp)]},
                }
            ],
        }
        if k == 0:
            chunk.update({key: value for key, value in meta.items() if value is not None})
        frames.append(chunk)
    n = len(step.tokens)
    frames.append(
        {"request_id": "generate-tokens-1", "usage": {"prompt_tokens": len(ids), "total_tokens": len(ids) + n,
                                                      "completion_tokens": n}, "output_mode": "tokens", "choices": []}
    )
    return sse(frames)


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

    async def generate(self, input_ids, params, *, session_id, on_tokens=None, images=()):
        ids = self.ids[: params.max_new_tokens]
        if on_tokens is not None:
            await on_tokens(ids, [-0.5] * len(ids))
        n = len(ids)
        return Generation(output_ids=list(ids), logprobs=[-0.5] * n, versions=[0] * n, proximal_logprobs_t=[-0.5] * n,
                          proximal_versions=[0] * n, finish_reason="stop" if n == len(self.ids) else "length",
                          prompt_tokens=len(input_ids))

    async def prefill_logprobs(self, input_ids, start, *, session_id, images=()):
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
