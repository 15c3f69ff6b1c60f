"""The Responses API's streamed event sequence: ``response.created``, ``response.in_progress``,
output items opened, deltas as the engine produces tokens, items done, then
``response.completed`` (or ``.incomplete`` / ``.failed``) carrying the final Response object
the turn committed. ``sequence_number`` increases monotonically."""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator

from tokenization.incremental import CONTENT, REASONING, IncrementalDecoder, StrippedText

from ..errors import APIError
from ..ids import message_id, reasoning_id, response_id
from .responses_output import ResponsesContext, message_item, output_text_part, reasoning_item, response_skeleton, tool_call_item
from .streaming import TurnStream, relay, sse_event

log = logging.getLogger("splice.responses")


class ResponseEventWriter:
    """Builds the SSE event sequence of one streamed response."""

    def __init__(self, skeleton: dict[str, Any], turn_id: str):
        self.seq = 0
        self.skeleton = skeleton
        self.turn_id = turn_id
        self.items: list[dict[str, Any]] = []  # final items, in output_index order
        self.rs_index: int | None = None
        self.rs_text = StrippedText()
        self.rs_closed = False
        self.msg_index: int | None = None
        self.msg_text = StrippedText()

    def event(self, typ: str, **fields: Any) -> bytes:
        data = {"type": typ, **fields, "sequence_number": self.seq}
        self.seq += 1
        return sse_event(typ, data)

    def start(self) -> list[bytes]:
        return [
            self.event("response.created", response=self.skeleton),
            self.event("response.in_progress", response=self.skeleton),
        ]

    # -- reasoning --------------------------------------------------------------------------
    def reasoning_delta(self, text: str) -> list[bytes]:
        out: list[bytes] = []
        if self.rs_closed:
            return out
        delta = self.rs_text.push(text)
        if not delta:
            return out
        if self.rs_index is None:
            out += self._open_reasoning()
        out.append(self.event("response.reasoning_text.delta", item_id=reasoning_id(self.turn_id), output_index=self.rs_index, content_index=0, delta=delta))
        return out

    def _open_reasoning(self) -> list[bytes]:
        self.rs_index = len(self.items)
        self.items.append(reasoning_item(self.turn_id, ""))
        item = {"id": reasoning_id(self.turn_id), "type": "reasoning", "summary": [], "content": []}
        rid = reasoning_id(self.turn_id)
        return [
            self.event("response.output_item.added", output_index=self.rs_index, item=item),
            self.event("response.content_part.added", item_id=rid, output_index=self.rs_index, content_index=0, part={"type": "reasoning_text", "text": ""}),
        ]

    def close_reasoning(self, final: str | None) -> list[bytes]:
        """End the reasoning item with ``final`` (the parse's text), or with what was streamed."""
        out: list[bytes] = []
        if self.rs_closed:
            return out
        self.rs_closed = True
        text = self.rs_text.sent if final is None else final
        if self.rs_index is None:
            if not text:
                return out
            out += self._open_reasoning()
        rid = reasoning_id(self.turn_id)
        rest = self.rs_text.remainder(text)
        if rest:
            out.append(self.event("response.reasoning_text.delta", item_id=rid, output_index=self.rs_index, content_index=0, delta=rest))
        elif rest is None:
            log.warning("streamed reasoning of %s differs from the parsed reasoning", self.turn_id)
        item = reasoning_item(self.turn_id, text)
        self.items[self.rs_index] = item
        out += [
            self.event("response.reasoning_text.done", item_id=rid, output_index=self.rs_index, content_index=0, text=text),
            self.event("response.content_part.done", item_id=rid, output_index=self.rs_index, content_index=0, part={"type": "reasoning_text", "text": text}),
            self.event("response.output_item.done", output_index=self.rs_index, item=item),
        ]
        return out

    # -- message ----------------------------------------------------------------------------
    def _open_message(self) -> list[bytes]:
        self.msg_index = len(self.items)
        mid = message_id(self.turn_id)
        self.items.append(message_item(self.turn_id, "", "in_progress"))
        item = {"id": mid, "type": "message", "role": "assistant", "status": "in_progress", "content": []}
        return [
            self.event("response.output_item.added", output_index=self.msg_index, item=item),
            self.event("response.content_part.added", item_id=mid, output_index=self.msg_index, content_index=0, part=output_text_part("")),
        ]

    def content_delta(self, text: str) -> list[bytes]:
        out: list[bytes] = []
        delta = self.msg_text.push(text)
        if not delta:
            return out
        if not self.rs_closed:
            out += self.close_reasoning(None)
        if self.msg_index is None:
            out += self._open_message()
        out.append(self.event("response.output_text.delta", item_id=message_id(self.turn_id), output_index=self.msg_index, content_index=0, delta=delta, logprobs=[]))
        return out

    def close_message(self, final: str, status: str, logprobs: list | None) -> list[bytes]:
        out: list[bytes] = []
        if self.msg_index is None:
            out += self._open_message()
        mid = message_id(self.turn_id)
        rest = self.msg_text.remainder(final)
        if rest:
            out.append(self.event("response.output_text.delta", item_id=mid, output_index=self.msg_index, content_index=0, delta=rest, logprobs=[]))
        elif rest is None:
            log.warning("streamed text of %s differs from the parsed text", self.turn_id)
        part = output_text_part(final, logprobs)
        item = message_item(self.turn_id, final, status, logprobs)
        self.items[self.msg_index] = item
        out += [
            self.event("response.output_text.done", item_id=mid, output_index=self.msg_index, content_index=0, text=final, logprobs=logprobs or []),
            self.event("response.content_part.done", item_id=mid, output_index=self.msg_index, content_index=0, part=part),
            self.event("response.output_item.done", output_index=self.msg_index, item=item),
        ]
        return out

    # -- function calls -------------------------------------------------------------------
    def function_call(self, k: int, name: str, arguments: str, ctx: ResponsesContext) -> list[bytes]:
        idx = len(self.items)
        final = tool_call_item(ctx.toolset, self.turn_id, k, name, arguments)
        self.items.append(final)
        fid = final["id"]
        if final["type"] == "custom_tool_call":
            added = dict(final, input="", status="in_progress")
            return [
                self.event("response.output_item.added", output_index=idx, item=added),
                self.event("response.custom_tool_call_input.delta", item_id=fid, output_index=idx, delta=final["input"]),
                self.event("response.custom_tool_call_input.done", item_id=fid, output_index=idx, input=final["input"]),
                self.event("response.output_item.done", output_index=idx, item=final),
            ]
        added = dict(final, arguments="", status="in_progress")
        return [
            self.event("response.output_item.added", output_index=idx, item=added),
            self.event("response.function_call_arguments.delta", item_id=fid, output_index=idx, delta=arguments),
            self.event("response.function_call_arguments.done", item_id=fid, output_index=idx, name=final["name"], arguments=arguments),
            self.event("response.output_item.done", output_index=idx, item=final),
        ]

    # -- end --------------------------------------------------------------------------------
    def finish(self, body: dict[str, Any]) -> bytes:
        typ = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
        return self.event(typ, response=body)

    def failed(self, err: APIError) -> bytes:
        body = dict(self.skeleton)
        body["status"] = "failed"
        body["output"] = [it for it in self.items]
        body["error"] = {"code": err.code or "server_error", "message": err.message}
        return self.event("response.failed", response=body)


def stream_response(ctx: ResponsesContext, stream: TurnStream) -> AsyncIterator[bytes]:
    """The event sequence; a failure after ``response.created`` ends it with ``response.failed``."""
    w = ResponseEventWriter(response_skeleton(ctx, ctx.turn_id), ctx.turn_id)
    return relay(_events(ctx, stream, w), stream, w.failed, f"response {response_id(ctx.turn_id)}")


async def _events(ctx: ResponsesContext, stream: TurnStream, w: ResponseEventWriter) -> AsyncIterator[bytes]:
    tid = ctx.turn_id
    dec = ctx.fmt.decoder(template_kwargs=ctx.turn.chat_template_kwargs)
    for chunk in w.start():
        yield chunk
    async for batch in stream.batches():
        frames: list[bytes] = []
        for channel, text in dec.feed(batch):
            frames += _channel_frames(w, dec, channel, text)
        if frames:
            yield b"".join(frames)
    frames = []
    for channel, text in dec.finish():
        frames += _channel_frames(w, dec, channel, text)
    result = stream.result()
    body = result.body
    p = result.parsed
    status = "incomplete" if result.finish_reason == "length" else "completed"
    lp = next((it["content"][0]["logprobs"] for it in body["output"] if it["type"] == "message"), None) or None
    if p.reasoning or w.rs_index is not None:
        frames += w.close_reasoning(p.reasoning or "")
        if w.rs_index is not None and w.items[w.rs_index]["content"][0]["text"] != (p.reasoning or ""):
            log.warning("streamed reasoning of %s differs from the parsed reasoning", tid)
    w.rs_closed = True
    if p.content or not p.tool_calls or w.msg_index is not None:
        frames += w.close_message(p.content, status, lp)
    for k, c in enumerate(p.tool_calls):
        frames += w.function_call(k, c.name, c.arguments, ctx)
    frames.append(w.finish(body))
    yield b"".join(frames)


def _channel_frames(w: ResponseEventWriter, dec: IncrementalDecoder, channel: str, text: str) -> list[bytes]:
    if channel == REASONING:
        return w.reasoning_delta(text)
    if channel == CONTENT:
        return w.content_delta(text)
    # tool-call text: the calls are emitted from the parse at the end; reasoning is over
    return w.close_reasoning(None) if not w.rs_closed and w.rs_index is not None else []
