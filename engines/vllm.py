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

The request bodies and reply parsing are pure functions in ``engines.vllm_wire`` (re-exported
here); this module is the client that sends them and the control calls.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Sequence

import httpx

from engines.client import TokensCallback, config_ties_head, model_card, positive_int, prefill_values
from engines.http import Http, clean_logprob, deadline, expect_dict
from engines.ids_json import IdsJson
from engines.resume import parse_version
from engines.sglang import ROUTING_HEADER, routing_value
from engines.types import (
    EngineBadResponse,
    EngineError,
    EngineImage,
    EngineInfo,
    EngineRejected,
    EngineUnsupported,
    SamplingParams,
    Segment,
)
from engines.vllm_wire import (  # the wire format; re-exported here
    _PATH,
    DEV_MODE_HINT,
    GENERATE_PATH,
    SCALE_OUT_HINT,
    TIED_HEAD_WARNING,
    check_placeholders,
    completion_payload,
    generate_tokens_payload,
    parse_completion,
    parse_generate,
    prompt_logprob_values,
    token_id,
)
from engines.vllm_worker import QUALNAME as EXTENSION_QUALNAME
from engines.vllm_worker import REFRESH_METHOD, RELOAD_METHOD
from engines.weight_transfer import TensorBatch, WeightGroup, vllm_finish_body, vllm_init_body, vllm_update_body

log = logging.getLogger(__name__)

__all__ = [
    "DEV_MODE_HINT", "GENERATE_PATH", "SCALE_OUT_HINT", "TIED_HEAD_WARNING", "VLLMClient", "check_placeholders",
    "completion_payload", "generate_tokens_payload", "parse_completion", "parse_generate", "prompt_logprob_values", "token_id",
]


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
        self.ids_json = IdsJson()  # each session's last long prompt as JSON: the next one appends to it
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
        payload = completion_payload(input_ids, params, model=self.model, echo=echo, stream=on_tokens is not None,
                                     encoded_ids=self.ids_json(routing_key, input_ids))  # fmt: skip
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

    async def _dev(self, method: str, path: str, body: dict | None = None, *, timeout: float | None = None,
                   idempotent: bool = False):
        """A dev-mode call; a missing route (HTTP 404) becomes ``EngineUnsupported``."""
        try:
            return await self.http.request(method, path, body=body, timeout=timeout or self.admin_timeout_s, allow_empty=True,
                                           idempotent=idempotent)
        except EngineRejected as exc:
            if " HTTP 404:" in str(exc):
                raise EngineUnsupported(f"{self.url}{path} does not exist: {DEV_MODE_HINT}", replica=self.url) from exc
            raise

    async def pause(self) -> None:
        await self._dev("POST", "/pause?mode=abort", idempotent=True)

    async def resume(self) -> None:
        await self._dev("POST", "/resume", idempotent=True)

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
