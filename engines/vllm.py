"""Async client for vLLM's OpenAI ``/v1/completions`` endpoint in token space (SPEC section 9).

The prompt goes in as ids; ids come back as ``"token_id:N"`` strings (and ``token_ids``), so
nothing is ever decoded and re-encoded. ``echo`` is only sent when prompt logprobs are owed,
because it disables prefix-cache reads. vLLM clamps ``-inf`` to ``-9999.0``; Splice keeps that
value (``engines.http.NEG_INF_LOGPROB``) for every engine. vLLM has no standard HTTP endpoint
for loading weights, so ``update_weights`` raises ``EngineUnsupported``: move weights with your
own mechanism and tell Splice the version (``EnginePool.set_version``).
"""

from __future__ import annotations

from typing import Any

import httpx

from engines.client import TokensCallback, prefill_values
from engines.http import Http, clean_logprob, expect_dict
from engines.types import (
    EngineBadResponse,
    EngineError,
    EngineUnsupported,
    FinishReason,
    SamplingParams,
    Segment,
)

_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}
_PATH = "/v1/completions"


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
    if params.stop:
        body["stop"] = list(params.stop)
    if params.stop_token_ids:
        body["stop_token_ids"] = [int(t) for t in params.stop_token_ids]
    return body


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

    async def generate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        *,
        rid: str,
        input_logprobs_from: int | None = None,
        on_tokens: TokensCallback | None = None,
        routing_key: str | None = None,
    ) -> Segment:
        """One completion call. ``rid`` and ``routing_key`` are unused: closing the connection
        aborts a request on vLLM, and vLLM has no router convention to honour."""
        echo = input_logprobs_from is not None
        payload = completion_payload(input_ids, params, model=self.model, echo=echo, stream=on_tokens is not None)
        if on_tokens is None:
            body = await self.http.request("POST", _PATH, body=payload, timeout=self.timeout_s)
            return parse_completion(body, input_ids, echo=echo, replica=self.url)
        return await self._stream(payload, input_ids, echo, on_tokens)

    async def _stream(self, payload: dict, input_ids: list[int], echo: bool, on_tokens: TokensCallback) -> Segment:
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
        async with self.http.stream(_PATH, payload, timeout=self.timeout_s) as resp:
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

    async def prefill(
        self, input_ids: list[int], start: int, *, routing_key: str | None = None
    ) -> tuple[list[float], str | None]:
        """A prompt-logprobs call: ``max_tokens: 1``, ``echo: true``; the sampled token is dropped."""
        if not 1 <= start <= len(input_ids):
            raise ValueError(f"prefill start must be in [1, {len(input_ids)}], got {start}")
        seg = await self.generate(input_ids, SamplingParams(max_new_tokens=1), rid="", input_logprobs_from=start)
        return prefill_values(seg, input_ids, start, self.url), None

    async def pause(self) -> None:
        await self.http.request("POST", "/pause?mode=abort", timeout=self.admin_timeout_s, allow_empty=True)

    async def resume(self) -> None:
        await self.http.request("POST", "/resume", timeout=self.admin_timeout_s, allow_empty=True)

    async def update_weights(self, model_path: str, version: int) -> None:
        raise EngineUnsupported(
            f"{self.url}: vLLM has no standard HTTP endpoint to load weights from {model_path!r}; "
            "load them with your trainer's mechanism, then set the version (POST /admin/version)",
            replica=self.url,
        )

    async def weight_version(self) -> str | None:
        return None  # vLLM does not report one

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
