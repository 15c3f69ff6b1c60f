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

Both honour per-request chat-template kwargs: the hand-coded renderer when the kwargs are ones
its config mirrors (Qwen3's ``enable_thinking``), otherwise the turn goes through the template
bridge with the kwargs; with neither available the bridge refuses
(``template_kwargs_unsupported``). Text in new messages that spells a control token stays text
(see ``tokenization.template``): such turns go through the template bridge, whose encoding
keeps it text; a hand-coded renderer would tokenize it as the control token.

Images: new messages with image parts go through the template bridge (hand-coded renderers
render text content only); it expands each ``<|image_pad|>`` the template wrote for the new
messages to that image's placeholder count (``tokenization.vision``). Images of the history
are already in the previous prompt and are never expanded again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import json
from collections import OrderedDict
from typing import Callable, Sequence

from renderers.base import should_rerender_for_thinking_retention

from .conversation import Message, Tool, has_images, message_images, to_renderer_messages, to_renderer_tools, to_template_tools
from .template import ControlTokens
from .vision import VisionSpec, expand_image_pads

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


def as_list(ids: Sequence[int]) -> list[int]:
    """Token ids as a list of ints: a numpy array (a spliced prompt) goes through ``tolist``."""
    return ids.tolist() if hasattr(ids, "tolist") else list(ids)


def prompt_tail(prompt_ids: Sequence[int], close_ids: set[int] | frozenset[int], limit: int = 4096) -> list[int]:
    """The prompt from its last turn close on (at most ``limit`` ids), as a list: all a
    renderer's bridge or parser reads of it. Costs the tail, not the prompt."""
    lo, end, step = max(0, len(prompt_ids) - limit), len(prompt_ids), 256
    while end > lo:  # the last close is usually a few tokens back: look there first
        start = max(lo, end - step)
        chunk = as_list(prompt_ids[start:end])
        for i in range(len(chunk) - 1, -1, -1):
            if chunk[i] in close_ids:
                return as_list(prompt_ids[start + i :])
        end, step = start, step * 4
    return as_list(prompt_ids[lo:])


class RendererBridge:
    """Bridge through a hand-coded renderer's ``bridge_to_next_turn``.

    ``renderer_for(kwargs)`` gives the renderer configured for a request's template kwargs, or
    ``None`` when the renderer cannot mirror them; ``fallback`` (a ``GenericBridge`` over the
    model's chat template) then bridges the turn. ``control`` finds control-token text in new
    messages, which the hand-coded renderer would encode as control tokens. New messages with
    images go to ``fallback`` too (hand-coded renderers render text content only).
    """

    def __init__(
        self,
        renderer,
        *,
        renderer_for: Callable[[dict], Any] | None = None,
        fallback: "GenericBridge | None" = None,
        control: ControlTokens | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ):
        self.renderer = renderer
        self._close_ids = set(renderer.get_stop_token_ids())
        self._renderer_for = renderer_for
        self.fallback = fallback
        self.control = control
        self.template_kwargs = dict(template_kwargs or {})

    def bridge(
        self,
        prev_prompt_ids: list[int],
        prev_output_ids: list[int],
        new_messages: list[Message],
        *,
        tools: list[Tool] | None = None,
        history: list[Message] | None = None,  # only the template fallback reads it
        template_kwargs: dict[str, Any] | None = None,
    ) -> BridgeResult:
        reason = precheck(new_messages)
        if reason:
            return refuse(reason)
        images = has_images(new_messages)
        msgs = to_renderer_messages(new_messages, images=False)
        kwargs = self.template_kwargs if template_kwargs is None else dict(template_kwargs)
        if self._renderer_for is not None:
            renderer = self._renderer_for(kwargs)
        else:
            renderer = self.renderer if kwargs == self.template_kwargs else None
        retention = getattr(renderer or self.renderer, "effective_thinking_retention", "all")
        is_query = getattr(renderer or self.renderer, "_is_user_query_message", None)
        qkw = {"is_user_query": is_query} if is_query else {}
        if should_rerender_for_thinking_retention(retention, msgs, **qkw):
            return refuse("thinking_stripped")
        special_text = self.control is not None and self.control.in_any(msgs)
        if renderer is None or special_text or images:
            if self.fallback is None:
                if images:
                    return refuse("images_need_template")
                return refuse("special_token_text" if renderer is not None else "template_kwargs_unsupported")
            return self.fallback.bridge(
                prev_prompt_ids, prev_output_ids, new_messages, tools=tools, history=history, template_kwargs=kwargs
            )
        tail = prompt_tail(prev_prompt_ids, self._close_ids)
        try:
            out = renderer.bridge_to_next_turn(tail, list(prev_output_ids), msgs, tools=to_renderer_tools(tools))
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


class RendererCache:
    """Hand-coded renderers per template-kwargs set (few distinct sets occur; bounded anyway)."""

    def __init__(self, make: Callable[[dict], Any], allowed: frozenset[str], default_kwargs: dict, default_renderer, size: int = 16):
        self._make = make
        self.allowed = allowed
        self._default_key = self._key(default_kwargs)
        self._cache: OrderedDict[str, Any] = OrderedDict()
        if set(default_kwargs) <= allowed:
            self._cache[self._default_key] = default_renderer
        self._size = size

    @staticmethod
    def _key(kwargs: dict) -> str:
        if not kwargs:  # most requests: no encoder needed for what json.dumps({}) returns
            return "{}"
        return json.dumps(kwargs, sort_keys=True, default=repr)

    def __call__(self, kwargs: dict):
        """The renderer for ``kwargs``, or ``None`` when it cannot mirror them."""
        if not set(kwargs) <= self.allowed:
            return None
        key = self._key(kwargs)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        try:
            renderer = self._make(kwargs)
        except Exception:  # e.g. a value the renderer's config rejects
            renderer = None
        self._cache[key] = renderer
        if len(self._cache) > self._size:
            self._cache.popitem(last=False)
        return renderer


class GenericBridge:
    """Bridge for chat templates no hand-coded renderer covers (see module docstring)."""

    def __init__(
        self,
        tokenizer,
        *,
        template_kwargs: dict[str, Any] | None = None,
        encoder=None,
        control: ControlTokens | None = None,
        vision: VisionSpec | None = None,
    ):
        self.tokenizer = tokenizer
        self.vision = vision
        self.control = control or ControlTokens(tokenizer, encoder)
        self.template_kwargs = dict(template_kwargs or {})
        self._keep_developer = "developer" in str(getattr(tokenizer, "chat_template", "") or "")
        self._special = set(getattr(tokenizer, "all_special_ids", []) or [])
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._special |= {i for i, t in added.items() if getattr(t, "special", False)}

    def _render_text(self, messages: list[dict], tools, add_generation_prompt: bool, kwargs: dict) -> str:
        kwargs = dict(kwargs)
        kwargs.pop("add_generation_prompt", None)
        kwargs.pop("tools", None)
        if tools:
            kwargs["tools"] = tools
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )

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
        template_kwargs: dict[str, Any] | None = None,
    ) -> BridgeResult:
        reason = precheck(new_messages)
        if reason:
            return refuse(reason)
        if not history or history[-1].role != "assistant":
            return refuse("no_assistant_turn")
        images = message_images(new_messages)
        if images and self.vision is None:
            return refuse("images_not_supported")
        kwargs = self.template_kwargs if template_kwargs is None else dict(template_kwargs)
        ctx = to_renderer_messages(self._context(history), keep_developer=self._keep_developer)
        new = to_renderer_messages(new_messages, keep_developer=self._keep_developer)
        rtools = to_template_tools(tools)
        c = self.control
        literals: list[str] = []
        marker = ""
        if c.in_any((ctx, new, rtools, kwargs)):  # control-token text: render with placeholders
            marker = c.pick_marker(ctx, new, rtools, kwargs, MARKER)
            ctx, new, rtools, kwargs = c.neutralize((ctx, new, rtools, kwargs), literals, marker)
        try:
            before = self._render_text(ctx, rtools, False, kwargs)
            after = self._render_text(ctx + new, rtools, True, kwargs)
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
        def encode(text: str) -> list[int]:
            return c.encode_rendered(text, literals, marker) if literals else c.encode(text)

        close_ids = encode(close_text)
        delta_ids = encode(delta_text)
        # The split between close and delta must be a token boundary of the joint encoding.
        if close_ids + delta_ids != encode(close_text + delta_text):
            return refuse("unstable_token_boundary")
        # The model usually samples the close's first (special) token; keep the sampled one.
        if close_ids and prev_output_ids and prev_output_ids[-1] == close_ids[0] and close_ids[0] in self._special:
            close_ids = close_ids[1:]
        elif prev_output_ids and prev_output_ids[-1] in self._special and close_ids and close_ids[0] in self._special:
            # Sampled a different terminator (e.g. EOS instead of end-of-turn): cannot prove.
            return refuse("unknown_turn_close")
        if self.vision is not None:
            # The template wrote one pad per image of the new messages (the context's images sit
            # before the marker): each becomes its image's placeholder span.
            pad = self.vision.image_pad_id
            if pad in close_ids or sum(1 for t in delta_ids if t == pad) != len(images):
                return refuse("image_count_mismatch")
            if images:
                delta_ids = expand_image_pads(delta_ids, images, pad)
        return BridgeResult(ids=close_ids + delta_ids)
