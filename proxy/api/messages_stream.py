"""The Messages API's streamed event grammar: ``message_start``, ``ping``, then per content
block ``content_block_start`` / ``content_block_delta`` (``thinking_delta`` + ``signature_delta``,
``text_delta``, ``input_json_delta``) / ``content_block_stop``, then ``message_delta`` (stop
reason, usage, the ``splice`` block) and ``message_stop``. Thinking and text stream token by
token; tool_use blocks are sent whole once the turn is parsed (a call is only known to be
well-formed when it is complete). A failure after the stream started is an ``error`` event."""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator

from tokenization.incremental import CONTENT, REASONING, StopTextFilter, StrippedText

from ..errors import APIError
from ..ids import message_id
from .jsonio import dumps
from .messages_errors import anthropic_error
from .messages_output import MessagesContext, message_skeleton
from .streaming import TurnStream, relay, sse_event

log = logging.getLogger("splice.messages")


class MessageEventWriter:
    """Builds the SSE event sequence of one streamed message."""

    def __init__(self, ctx: MessagesContext):
        self.ctx = ctx
        self.index = -1
        self.open: str | None = None  # type of the block being streamed
        self.thinking = StrippedText()
        self.thinking_done = False
        self.text = StrippedText()
        self.text_opened = False
        self.stop = StopTextFilter(ctx.turn.stop)

    def event(self, typ: str, **fields: Any) -> bytes:
        return sse_event(typ, {"type": typ, **fields})

    def start(self) -> list[bytes]:
        return [self.event("message_start", message=message_skeleton(self.ctx)), self.event("ping")]

    def _open(self, block: dict[str, Any]) -> bytes:
        self.index += 1
        self.open = block["type"]
        return self.event("content_block_start", index=self.index, content_block=block)

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return self.event("content_block_delta", index=self.index, delta=delta)

    def _stop(self) -> bytes:
        self.open = None
        return self.event("content_block_stop", index=self.index)

    # -- thinking ---------------------------------------------------------------------------
    def thinking_delta(self, text: str) -> list[bytes]:
        if self.thinking_done:
            return []
        d = self.thinking.push(text)
        if not d:
            return []
        out = [] if self.open == "thinking" else [self._open({"type": "thinking", "thinking": "", "signature": ""})]
        return out + [self._delta({"type": "thinking_delta", "thinking": d})]

    def close_thinking(self, final: str | None) -> list[bytes]:
        """End the thinking block with ``final`` (the parse's reasoning) or what was streamed."""
        if self.thinking_done:
            return []
        self.thinking_done = True
        text = self.thinking.sent if final is None else final
        out: list[bytes] = []
        if self.open != "thinking":
            if not text:
                return out
            out.append(self._open({"type": "thinking", "thinking": "", "signature": ""}))
        rest = self.thinking.remainder(text)
        if rest:
            out.append(self._delta({"type": "thinking_delta", "thinking": rest}))
        elif rest is None:
            log.warning("streamed thinking of %s differs from the parsed reasoning", self.ctx.turn_id)
        out.append(self._delta({"type": "signature_delta", "signature": self.ctx.turn_id}))
        out.append(self._stop())
        return out

    # -- text -------------------------------------------------------------------------------
    def text_delta(self, text: str) -> list[bytes]:
        d = self.text.push(self.stop.push(text))
        if not d:
            return []
        out = self.close_thinking(None)
        if self.open != "text":
            self.text_opened = True
            out.append(self._open({"type": "text", "text": ""}))
        out.append(self._delta({"type": "text_delta", "text": d}))
        return out

    def close_text(self, final: str) -> list[bytes]:
        """End the text block with ``final`` (the parse's text), opening it if nothing streamed."""
        out: list[bytes] = []
        tail = self.text.push(self.stop.flush())
        if not self.text_opened:
            self.text_opened = True
            out += self.close_thinking(None)
            out.append(self._open({"type": "text", "text": ""}))
        if tail:
            out.append(self._delta({"type": "text_delta", "text": tail}))
        rest = self.text.remainder(final)
        if rest:
            out.append(self._delta({"type": "text_delta", "text": rest}))
        elif rest is None:
            log.warning("streamed text of %s differs from the parsed text", self.ctx.turn_id)
        out.append(self._stop())
        return out

    # -- tool use ---------------------------------------------------------------------------
    def tool_use(self, block: dict[str, Any]) -> list[bytes]:
        return [
            self._open({"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}),
            self._delta({"type": "input_json_delta", "partial_json": dumps(block["input"]).decode()}),
            self._stop(),
        ]

    # -- end --------------------------------------------------------------------------------
    def finish(self, body: dict[str, Any]) -> list[bytes]:
        delta = {"stop_reason": body["stop_reason"], "stop_sequence": body["stop_sequence"]}
        return [
            self.event("message_delta", delta=delta, usage=body["usage"], splice=body.get("splice")),
            self.event("message_stop"),
        ]


def stream_message(ctx: MessagesContext, stream: TurnStream) -> AsyncIterator[bytes]:
    """Anthropic's event sequence; a failure after ``message_start`` ends it with an ``error`` event."""
    w = MessageEventWriter(ctx)
    return relay(_events(ctx, stream, w), stream, _error_event, f"message {message_id(ctx.turn_id)}")


def _error_event(err: APIError) -> bytes:
    _status, payload = anthropic_error(err.status, err.message)
    return sse_event("error", payload)


async def _events(ctx: MessagesContext, stream: TurnStream, w: MessageEventWriter) -> AsyncIterator[bytes]:
    dec = ctx.fmt.decoder(template_kwargs=ctx.turn.chat_template_kwargs)

    def frames_of(events) -> list[bytes]:
        out: list[bytes] = []
        for channel, text in events:
            if channel == REASONING:
                out += w.thinking_delta(text)
            elif channel == CONTENT:
                out += w.text_delta(text)
            else:  # tool-call text: calls are sent from the parse at the end; thinking is over
                out += w.close_thinking(None) if w.open == "thinking" else []
        return out

    yield b"".join(w.start())
    async for batch in stream.batches():
        frames = frames_of(dec.feed(batch))
        if frames:
            yield b"".join(frames)
    frames = frames_of(dec.finish())
    result = stream.result()
    body = result.body
    p = result.parsed
    frames += w.close_thinking(p.reasoning or "")
    if p.content or not p.tool_calls or w.text_opened:
        frames += w.close_text(p.content)
    for block in body["content"]:
        if block["type"] == "tool_use":
            frames += w.tool_use(block)
    frames += w.finish(body)
    yield b"".join(frames)
