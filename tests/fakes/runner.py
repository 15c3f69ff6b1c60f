"""A scripted session layer and an in-memory response store: what the front ends run against
in unit tests, with the real Qwen3 tokenizer and chat format."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Callable

from engines.types import Generation
from proxy.session import TurnRequest, TurnResult
from tokenization import ChatFormat
from tokenization.parse import parse_output


class MemoryStore:
    """Stored responses (``proxy.store.ResponseTable``'s interface), in memory."""

    def __init__(self):
        self.responses: dict[str, tuple[bytes, bytes]] = {}
        self.meta: dict[str, tuple[str, str]] = {}

    def put(self, response_id, session_id, turn_id, body, conversation):
        self.responses[response_id] = (bytes(body), bytes(conversation))
        self.meta[response_id] = (session_id, turn_id)

    def get(self, response_id):
        return self.responses.get(response_id)


class ScriptedRunner:
    """A deterministic session layer: replies with scripted assistant texts, token by token.

    Each reply is tokenized with the real tokenizer and handed to ``on_tokens`` ``chunk`` ids
    at a time; logprobs are made up but distinct per position.
    """

    def __init__(self, tok, renderer, *, store: MemoryStore | None = None, chunk: int = 3, model_name: str = "splice-test"):
        self.fmt = ChatFormat(tok, "qwen3")
        self.tokenizer = tok
        self.renderer = renderer
        self.store = store
        self.model_name = model_name
        self.chunk = chunk
        self.replies: deque[str | Callable[[TurnRequest], str] | BaseException] = deque()
        self.default_reply = "OK.<|im_end|>"
        self.requests: list[TurnRequest] = []
        self.results: list[TurnResult] = []
        self.delay = 0.0
        self.fail_after: int | None = None  # raise after this many streamed ids
        self.cancelled = 0

    def script(self, *replies) -> "ScriptedRunner":
        self.replies.extend(replies)
        return self

    def reset(self) -> None:
        self.replies.clear()
        self.requests.clear()
        self.results.clear()
        self.chunk = 3
        self.delay = 0.0
        self.fail_after = None
        self.cancelled = 0

    async def run(self, req: TurnRequest, on_tokens=None) -> TurnResult:
        self.requests.append(req)
        reply = self.replies.popleft() if self.replies else self.default_reply
        if isinstance(reply, BaseException):
            raise reply
        text = reply(req) if callable(reply) else reply
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        finish = "stop"
        if req.max_output_tokens is not None and len(ids) > req.max_output_tokens:
            ids = ids[: req.max_output_tokens]
            finish = "length"
        if on_tokens is not None:
            try:
                for i in range(0, len(ids), self.chunk):
                    if self.fail_after is not None and i >= self.fail_after:
                        raise RuntimeError("engine went away")
                    part = ids[i : i + self.chunk]
                    await on_tokens(part, [0.0] * len(part))
                    await asyncio.sleep(self.delay)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        lps = [-0.05 - 0.01 * (i % 17) for i in range(len(ids))]
        gen = Generation(
            output_ids=list(ids),
            logprobs=lps,
            versions=[0] * len(ids),
            proximal_logprobs_t=list(lps),
            proximal_versions=[0] * len(ids),
            finish_reason=finish,
            prompt_tokens=17,
            cached_tokens=5,
        )
        parsed = parse_output(self.renderer, ids, finish_reason=finish)
        turn_id = req.turn_id
        req.session_resolved = req.session_id or "sess-auto"
        result = TurnResult(
            turn_id=turn_id,
            session_id=req.session_id or "sess-auto",
            response_id=("resp_" if req.api == "responses" else "chatcmpl-") + turn_id,
            prompt_ids=list(range(17)),
            generation=gen,
            parsed=parsed,
            spliced=len(self.results) > 0,
            fork_reason=None,
            created_at=time.time(),
            model=req.model or self.model_name,
        )
        if req.present is not None:  # what the session layer does before its commit
            presented = req.present(result)
            result.body, result.encoded = presented.body, presented.encoded
            if presented.conversation is not None and self.store is not None:
                self.store.put(result.response_id, result.session_id, turn_id, presented.encoded, presented.conversation)
        self.results.append(result)
        return result
