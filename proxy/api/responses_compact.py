"""Remote compaction on the Responses API, answered by the served model (docs/agents.md).

Codex can compact a long thread on the server instead of summarising it itself: with
``POST /v1/responses/compact`` (the history as ``input``, answered with one JSON object whose
``output`` ends with one ``compaction`` item) or with a ``compaction_trigger`` item at the end
of an ordinary ``POST /v1/responses`` (answered with exactly one ``compaction`` output item).
Either way the client later sends the ``compaction`` item back, in place of the history it
replaced, and treats its ``encrypted_content`` as opaque.

Splice makes the summary a policy turn: the history plus a summarisation instruction, offered
no tools, is a recorded turn of the episode spliced onto the history it summarises
(proxy.session.roles). The ``compaction`` item's ``encrypted_content`` is a Splice handle (not
encrypted: the summary turn's id and its text, zlib + base64url). A later request holding it
sees, in its place, a user message with the summary, and continues as the episode's
``compacted`` segment whose parent is the summary turn; the summary's sampled ids are carried
into its prompt.
"""

from __future__ import annotations

import base64
import time
import zlib
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import orjson
from fastapi import Request

from tokenization.conversation import Message

from ..errors import bad_request
from ..ids import response_id, turn_id_from
from ..session import Presentation, TurnResult, TurnRunner
from .jsonio import dumps
from .output import splice_info, usage_of

HANDLE_PREFIX = "splice.cmp.v1."
ITEM_TYPES = ("compaction", "compaction_summary")  # what Codex sends a compaction back as (the second, older)
# The instruction the summary turn answers; it starts with the phrase Splice (and Codex's own
# inline compaction) marks a summarisation request by (proxy.session.roles.SUMMARY_REQUEST_MARKERS).
SUMMARY_INSTRUCTION = (
    "You are performing a CONTEXT CHECKPOINT COMPACTION. Write a summary of the conversation so far for the model "
    "that will continue the task from it: the goal, what has been done and decided, the facts it will need, and what "
    "remains to do."
)
# What the restarted history holds in place of the compaction item; it starts with the phrase a
# restart is recognised by (proxy.session.roles.RESTART_MARKERS).
SUMMARY_PREFIX = "Another language model started to solve this problem and produced a summary of its work so far. Continue from it:"


def handle(turn_id: str, summary: str) -> str:
    raw = orjson.dumps({"t": turn_id, "s": summary})
    return HANDLE_PREFIX + base64.urlsafe_b64encode(zlib.compress(raw, 6)).decode().rstrip("=")


def read_handle(value: Any, where: str) -> tuple[str, str]:
    """``(summary turn id, summary text)`` of a handle Splice issued; 400 for anything else."""
    if not isinstance(value, str) or not value.startswith(HANDLE_PREFIX):
        raise bad_request(f"{where}.encrypted_content is not a compaction issued by this server", code="invalid_value",
                          param=f"{where}.encrypted_content")  # fmt: skip
    body = value[len(HANDLE_PREFIX) :]
    try:
        d = orjson.loads(zlib.decompress(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))))
        turn, text = d["t"], d["s"]
        if not isinstance(text, str) or turn_id_from(turn) != turn:
            raise ValueError(turn)
    except (ValueError, KeyError, TypeError, zlib.error, orjson.JSONDecodeError):
        raise bad_request(f"{where}.encrypted_content is not a valid Splice compaction", code="invalid_value",
                          param=f"{where}.encrypted_content") from None  # fmt: skip
    return turn, text


def expand(item: dict[str, Any], where: str) -> tuple[Message, str]:
    """A ``compaction`` input item as the user message it stands for, and its summary turn."""
    turn, text = read_handle(item.get("encrypted_content"), where)
    return Message(role="user", content=f"{SUMMARY_PREFIX}\n{text}"), turn


def any_of_type(items: list[Any], types: frozenset[str]) -> bool:
    """Whether an input item may have one of ``types`` (True also when an item is not an
    object: the caller's own walk then reports it). A walk at C speed: a long input is
    scanned every turn."""
    try:
        return not types.isdisjoint(map(dict.get, items, repeat("type")))
    except TypeError:
        return True


_TRIGGER = frozenset(("compaction_trigger",))
_COMPACTIONS = frozenset(ITEM_TYPES)


def is_trigger(item: Any) -> bool:
    return isinstance(item, dict) and item.get("type") == "compaction_trigger"


def split_trigger(items: Any) -> tuple[Any, bool]:
    """``(input without a final compaction_trigger, whether there was one)``; 400 for a trigger
    anywhere but last."""
    if not isinstance(items, list) or not any_of_type(items, _TRIGGER) or not any(is_trigger(it) for it in items):
        return items, False
    if not is_trigger(items[-1]) or sum(map(is_trigger, items)) > 1:
        raise bad_request("a compaction_trigger item must be the last input item, and only one", code="invalid_value", param="input")
    return items[:-1], True


def summary_messages(messages: list[Message]) -> list[Message]:
    return [*messages, Message(role="user", content=SUMMARY_INSTRUCTION)]


def compaction_item(result: TurnResult) -> dict[str, Any]:
    text = (result.parsed.content or "").strip()
    return {"id": f"cmp_{result.turn_id}", "type": "compaction", "encrypted_content": handle(result.turn_id, text)}


def compacted_from(items: Any) -> str | None:
    """The summary turn of the last ``compaction`` item of a Responses input (None: none)."""
    found = None
    if isinstance(items, list) and any_of_type(items, _COMPACTIONS):
        for i, it in enumerate(items):
            if isinstance(it, dict) and it.get("type") in ITEM_TYPES:
                found = read_handle(it.get("encrypted_content"), f"input[{i}]")[0]
    return found


def trigger_events(skeleton: dict[str, Any], body: dict[str, Any]) -> list[bytes]:
    """The SSE events of a ``compaction_trigger`` answer: its one item, then the response."""
    from .streaming import sse_event

    item = body["output"][0]
    events = [
        ("response.created", {"response": skeleton}),
        ("response.in_progress", {"response": skeleton}),
        ("response.output_item.added", {"output_index": 0, "item": {"id": item["id"], "type": "compaction"}}),
        ("response.output_item.done", {"output_index": 0, "item": item}),
        ("response.incomplete" if body["status"] == "incomplete" else "response.completed", {"response": body}),
    ]
    return [sse_event(typ, {"type": typ, **fields, "sequence_number": k}) for k, (typ, fields) in enumerate(events)]


def kept_user_items(history: list[Message]) -> list[dict[str, Any]]:
    """The user messages a compacted history keeps (as OpenAI's compact answer does), without
    earlier summaries."""
    out = []
    for m in history:
        if m.role == "user" and m.content and not m.content.startswith(SUMMARY_PREFIX):
            out.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": m.content}]})
    return out


@dataclass
class CompactContext:
    """``POST /v1/responses/compact``: what the answer needs."""

    turn: Any
    fmt: Any
    history: list[Message]
    model: str

    def present(self, result: TurnResult) -> Presentation:
        u = usage_of(self.fmt, result, self.turn.chat_template_kwargs)
        body = {
            "id": response_id(result.turn_id),
            "object": "response.compaction",
            "created_at": int(time.time()),
            "output": [*kept_user_items(self.history), compaction_item(result)],
            "usage": {
                "input_tokens": u.prompt_tokens,
                "input_tokens_details": {"cached_tokens": u.cached_tokens},
                "output_tokens": u.output_tokens,
                "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
                "total_tokens": u.total_tokens,
            },
            "splice": splice_info(result, self.turn),
        }
        return Presentation(body=body, encoded=dumps(body))


def register(router, runner: TurnRunner, store, images, build_context) -> None:
    """Add ``POST /v1/responses/compact`` to the Responses router."""
    from .jsonio import JSONResponse, build, parse_json_body
    from .output import splice_headers
    from .streaming import run_turn

    @router.post("/v1/responses/compact")
    async def compact(request: Request):
        body = parse_json_body(await request.body())
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object", code="invalid_value")
        body = {k: v for k, v in body.items() if k not in ("stream", "tool_choice", "tools")}
        req_images = await images.prepare(body) if images is not None else None
        ctx = build(build_context, body, request.headers, runner, store, req_images)
        treq = ctx.turn
        treq.messages = summary_messages(treq.messages)
        cctx = CompactContext(turn=treq, fmt=runner.fmt, history=ctx.history, model=ctx.model)
        treq.present = cctx.present
        result = await run_turn(runner, treq, request)
        return JSONResponse(result.encoded, headers=splice_headers(result))
