"""``ChatFormat``: everything the proxy needs from a model's chat format, in one object.

Full render (first turn, or a fork), the splice bridge, output parsing and stop ids, for a
hand-coded `renderers` renderer or, when none covers the model, the tokenizer's own chat
template through `renderers`' ``DefaultRenderer`` plus Splice's generic bridge.
"""

from __future__ import annotations

from typing import Any

from renderers import create_renderer
from renderers.configs import DefaultRendererConfig

from .bridge import BridgeResult, GenericBridge, RendererBridge
from .conversation import Message, Tool, to_renderer_messages, to_renderer_tools
from .fast_tokenizer import FastTokenizer
from .incremental import IncrementalDecoder, generation_starts_in_reasoning, reasoning_token_count, token_bytes
from .loader import make_renderer
from .parse import ParsedOutput, parse_output


def _generic_renderer(tokenizer, template_kwargs: dict[str, Any] | None):
    vocab = tokenizer.get_vocab()
    tool_parser = "qwen3" if "<tool_call>" in vocab and "</tool_call>" in vocab else None
    reasoning_parser = "think" if "<think>" in vocab and "</think>" in vocab else None
    cfg = DefaultRendererConfig(tool_parser=tool_parser, reasoning_parser=reasoning_parser, **(template_kwargs or {}))
    return create_renderer(tokenizer, cfg)


class ChatFormat:
    """A model's chat format. ``renderer_name=None`` selects the generic path."""

    def __init__(
        self,
        tokenizer,
        renderer_name: str | None = None,
        *,
        thinking_retention: str = "all",
        template_kwargs: dict[str, Any] | None = None,
    ):
        self.tokenizer = tokenizer
        self.renderer_name = renderer_name
        self.thinking_retention = thinking_retention
        self.template_kwargs = dict(template_kwargs or {})
        fast = FastTokenizer(tokenizer)
        if renderer_name is not None:
            self.renderer = make_renderer(
                fast, renderer_name, thinking_retention=thinking_retention, template_kwargs=template_kwargs
            )
            self._bridge = RendererBridge(self.renderer)
        else:
            self.renderer = _generic_renderer(tokenizer, template_kwargs)
            self._bridge = GenericBridge(tokenizer, template_kwargs=template_kwargs, encoder=fast)
        self._stop_ids = frozenset(self.renderer.get_stop_token_ids())
        self._starts_in_reasoning: bool | None = None
        self.render_calls = 0  # full renders done; lets tests prove the bridge does not re-render

    @property
    def is_generic(self) -> bool:
        return self.renderer_name is None

    # -- tokenizer facts the front ends need (derived once, here, not by each caller) ---------

    @property
    def stop_token_ids(self) -> list[int]:
        return list(self._stop_ids)

    @property
    def starts_in_reasoning(self) -> bool:
        """Whether the generation prompt leaves ``<think>`` open (the output starts as reasoning)."""
        if self._starts_in_reasoning is None:
            self._starts_in_reasoning = generation_starts_in_reasoning(
                self.tokenizer, self.renderer, template_kwargs=self.template_kwargs
            )
        return self._starts_in_reasoning

    def token_bytes(self, ids: list[int]) -> list[bytes]:
        """The exact bytes of each token (for OpenAI's logprob entries)."""
        return token_bytes(self.tokenizer, list(ids))

    def reasoning_token_count(self, output_ids: list[int]) -> int:
        """Output tokens spent in the initial reasoning region, markers included."""
        return reasoning_token_count(
            self.tokenizer, list(output_ids), start_in_reasoning=self.starts_in_reasoning, stop_ids=self._stop_ids
        )

    def decoder(self) -> IncrementalDecoder:
        """A fresh incremental decoder for one streamed output (same boundaries as ``parse``)."""
        return IncrementalDecoder(self.tokenizer, start_in_reasoning=self.starts_in_reasoning, stop_ids=self._stop_ids)

    def render(self, messages: list[Message], tools: list[Tool] | None = None, *, add_generation_prompt: bool = True) -> list[int]:
        """Full render of a conversation to prompt ids."""
        self.render_calls += 1
        return list(
            self.renderer.render_ids(
                to_renderer_messages(messages), tools=self.renderer_tools(tools), add_generation_prompt=add_generation_prompt
            )
        )

    def renderer_tools(self, tools: list[Tool] | None):
        specs = to_renderer_tools(tools)
        if specs and self.is_generic:
            # apply_chat_template templates expect OpenAI's nested shape.
            return [{"type": "function", "function": s} for s in specs]
        return specs

    def bridge(
        self,
        prev_prompt_ids: list[int],
        prev_output_ids: list[int],
        new_messages: list[Message],
        *,
        tools: list[Tool] | None = None,
        history: list[Message] | None = None,
    ) -> BridgeResult:
        """Ids to append after ``prev_prompt_ids + prev_output_ids``, or a refusal with a reason."""
        return self._bridge.bridge(prev_prompt_ids, prev_output_ids, new_messages, tools=tools, history=history)

    def parse(
        self,
        output_ids: list[int],
        *,
        prompt_ids: list[int] | None = None,
        tools: list[Tool] | None = None,
        finish_reason: str = "stop",
        stop_text: str | None = None,
    ) -> ParsedOutput:
        """``stop_text``: the stop string the engine matched; the text ends before it (as OpenAI's
        does) while the recorded ids keep everything that was sampled."""
        tail = prompt_ids[-64:] if prompt_ids else None  # the parser reads only the assistant header
        return parse_output(
            self.renderer, output_ids, prompt_ids=tail, tools=to_renderer_tools(tools), finish_reason=finish_reason,
            stop_text=stop_text,
        )
