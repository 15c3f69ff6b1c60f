"""The splice bridge: the ids to append after ``prompt[K-1] + output[K-1]`` for turn K.

``bridge_ids = close of the previous assistant turn (if the model did not sample it)
+ the template's rendering of the new messages + the generation prompt``.

Two implementations behind one result type:

* ``RendererBridge`` delegates to a hand-coded `renderers` renderer's ``bridge_to_next_turn``.
  It passes only the tail of the previous prompt (from its last turn close), so the cost of a
  turn does not grow with the conversation.
* ``GenericBridge`` works for any chat template: it renders a small conversation (the
  preamble, the last assistant turn replaced by a marker, the new messages) with and without
  the new messages, takes the difference only when the shorter render is an exact prefix,
  reads the assistant close from the text after the marker, and refuses when any check fails.

Either returns ``BridgeResult(ids=None, reason=...)`` when it cannot prove the splice; the
caller then renders the turn in full and records a fork with that reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from renderers.base import should_rerender_for_thinking_retention

from .conversation import Message, Tool, to_renderer_messages, to_renderer_tools

MARKER = "\u2063splice\u2063marker\u2063"


@dataclass(frozen=True)
class BridgeResult:
    ids: list[int] | None
    reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.ids is not None


def refuse(reason: str) -> BridgeResult:
    return BridgeResult(ids=None, reason=reason)


def precheck(new_messages: list[Message]) -> str | None:
    """Reasons any bridge refuses, independent of the template."""
    if not new_messages:
        return "no_new_messages"
    if any(m.role == "assistant" for m in new_messages):
        # An assistant message Splice did not sample: its tokens would be re-tokenized text.
        return "history_edited"
    return None


def _prompt_tail(prompt_ids: list[int], close_ids: set[int], limit: int = 4096) -> list[int]:
    """The prompt from its last turn close on: all a renderer's bridge reads of it."""
    stop = max(0, len(prompt_ids) - limit)
    for i in range(len(prompt_ids) - 1, stop - 1, -1):
        if prompt_ids[i] in close_ids:
            return prompt_ids[i:]
    return prompt_ids[stop:]


class RendererBridge:
    """Bridge through a hand-coded renderer's ``bridge_to_next_turn``."""

    def __init__(self, renderer):
        self.renderer = renderer
        self._close_ids = set(renderer.get_stop_token_ids())

    def bridge(
        self,
        prev_prompt_ids: list[int],
        prev_output_ids: list[int],
        new_messages: list[Message],
        *,
        tools: list[Tool] | None = None,
        history: list[Message] | None = None,  # unused: the renderer needs no history
    ) -> BridgeResult:
        reason = precheck(new_messages)
        if reason:
            return refuse(reason)
        msgs = to_renderer_messages(new_messages)
        retention = getattr(self.renderer, "effective_thinking_retention", "all")
        is_query = getattr(self.renderer, "_is_user_query_message", None)
        kwargs = {"is_user_query": is_query} if is_query else {}
        if should_rerender_for_thinking_retention(retention, msgs, **kwargs):
            return refuse("thinking_stripped")
        tail = _prompt_tail(prev_prompt_ids, self._close_ids)
        try:
            out = self.renderer.bridge_to_next_turn(tail, list(prev_output_ids), msgs, tools=to_renderer_tools(tools))
        except Exception as exc:  # a renderer bug must not take the request down: fork instead
            return refuse(f"bridge_error:{type(exc).__name__}")
        if out is None:
            return refuse("bridge_refused")
        ids = out.token_ids
        n = len(tail) + len(prev_output_ids)
        # The renderer may trim sampled tokens after a turn close; that would break the prefix.
        if len(ids) < n or ids[len(tail) : n] != list(prev_output_ids) or ids[: len(tail)] != tail:
            return refuse("sampled_tokens_not_kept")
        return BridgeResult(ids=list(ids[n:]))


class GenericBridge:
    """Bridge for chat templates no hand-coded renderer covers (see module docstring)."""

    def __init__(self, tokenizer, *, template_kwargs: dict[str, Any] | None = None, encoder=None):
        self.tokenizer = tokenizer
        self._encoder = encoder or tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self._special = set(getattr(tokenizer, "all_special_ids", []) or [])
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._special |= {i for i, t in added.items() if getattr(t, "special", False)}

    def _render_text(self, messages: list[dict], tools, add_generation_prompt: bool) -> str:
        kwargs = dict(self.template_kwargs)
        if tools:
            kwargs["tools"] = tools
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def _encode(self, text: str) -> list[int]:
        return self._encoder.encode(text, add_special_tokens=False) if text else []

    @staticmethod
    def _context(history: list[Message]) -> list[Message]:
        """The preamble plus the last assistant turn, its content replaced by the marker.

        Bounded by the current turn, so the render does not grow with the conversation.
        """
        preamble: list[Message] = []
        for m in history:
            if m.role in ("system", "developer"):
                preamble.append(m)
            else:
                break
        last_user = None
        for i in range(len(history) - 1, -1, -1):
            if history[i].role == "user":
                last_user = history[i]
                break
        ctx = list(preamble)
        if last_user is not None:
            ctx.append(last_user)
        ctx.append(Message(role="assistant", content=MARKER))
        return ctx

    def bridge(
        self,
        prev_prompt_ids: list[int],
        prev_output_ids: list[int],
        new_messages: list[Message],
        *,
        tools: list[Tool] | None = None,
        history: list[Message] | None = None,
    ) -> BridgeResult:
        reason = precheck(new_messages)
        if reason:
            return refuse(reason)
        if not history or history[-1].role != "assistant":
            return refuse("no_assistant_turn")
        ctx = to_renderer_messages(self._context(history))
        new = to_renderer_messages(new_messages)
        rtools = [{"type": "function", "function": t} for t in (to_renderer_tools(tools) or [])] or None
        try:
            before = self._render_text(ctx, rtools, add_generation_prompt=False)
            after = self._render_text(ctx + new, rtools, add_generation_prompt=True)
        except Exception as exc:
            return refuse(f"template_error:{type(exc).__name__}")
        # Only what follows the marker is used: the previous turn's own rendering may differ
        # between the two (templates strip history), and Splice keeps the sampled ids anyway.
        if before.count(MARKER) != 1 or after.count(MARKER) != 1:
            return refuse("marker_not_unique")
        close_text = before[before.index(MARKER) + len(MARKER) :]
        after_tail = after[after.index(MARKER) + len(MARKER) :]
        if not after_tail.startswith(close_text):
            return refuse("render_not_prefix")
        delta_text = after_tail[len(close_text) :]
        close_ids = self._encode(close_text)
        delta_ids = self._encode(delta_text)
        # The split between close and delta must be a token boundary of the joint encoding.
        if close_ids + delta_ids != self._encode(close_text + delta_text):
            return refuse("unstable_token_boundary")
        # The model usually samples the close's first (special) token; keep the sampled one.
        if close_ids and prev_output_ids and prev_output_ids[-1] == close_ids[0] and close_ids[0] in self._special:
            close_ids = close_ids[1:]
        elif prev_output_ids and prev_output_ids[-1] in self._special and close_ids and close_ids[0] in self._special:
            # Sampled a different terminator (e.g. EOS instead of end-of-turn): cannot prove.
            return refuse("unknown_turn_close")
        return BridgeResult(ids=close_ids + delta_ids)
