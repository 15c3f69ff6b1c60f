"""``ChatFormat``: everything the proxy needs from a model's chat format, in one object.

Full render (first turn, or a fork), the splice bridge, output parsing and stop ids.

* A full render is the model's own chat template (``tokenizer.apply_chat_template``) applied to
  the request, token for token, tools in OpenAI's nested shape; text that spells a control
  token stays text (``tokenization.template``). Only a tokenizer without a chat template is
  rendered by the hand-coded renderer instead.
* The bridge is the hand-coded `renderers` renderer's ``bridge_to_next_turn`` when one covers
  the model (cheap, token level), else Splice's generic bridge over the chat template.
* Parsing and stop ids come from the hand-coded renderer, or `renderers`' ``DefaultRenderer``.

``vision`` (a ``VisionSpec``, for a Qwen2-VL-family model) lets messages carry images: renders
and bridges expand each image's placeholder (``docs/images.md``); without it images are a
``VisionNotSupported`` error.

``template_kwargs`` given at construction apply to every request; a request's own
``chat_template_kwargs`` (the ``template_kwargs`` argument of ``render`` and ``bridge``) are
merged over them.
"""

from __future__ import annotations

from typing import Any, Sequence

from renderers import create_renderer
from renderers.configs import DefaultRendererConfig

from .bridge import BridgeResult, GenericBridge, RendererBridge, RendererCache, as_list
from .conversation import Message, Tool, message_images, to_renderer_messages, to_renderer_tools, to_template_tools
from .fast_tokenizer import FastTokenizer
from .incremental import IncrementalDecoder, generation_starts_in_reasoning, marker_ids, reasoning_token_count, token_bytes
from .loader import make_renderer
from .parse import ParsedOutput, parse_output
from .template import ControlTokens, TemplateRenderer
from .vision import VisionNotSupported, VisionSpec, expand_image_pads


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
        vision: VisionSpec | None = None,
    ):
        self.tokenizer = tokenizer
        self.renderer_name = renderer_name
        self.vision = vision
        self.thinking_retention = thinking_retention
        self.template_kwargs = dict(template_kwargs or {})
        fast = FastTokenizer(tokenizer)
        self.control = ControlTokens(tokenizer, fast)
        self.template = TemplateRenderer(tokenizer, self.control)
        template_bridge = (
            GenericBridge(tokenizer, template_kwargs=self.template_kwargs, encoder=fast, control=self.control, vision=vision)
            if self.template.available
            else None
        )
        if renderer_name is not None:
            from renderers.configs import config_from_name

            allowed = frozenset(type(config_from_name(renderer_name)).template_field_names())

            def make(kwargs: dict):
                return make_renderer(fast, renderer_name, thinking_retention=thinking_retention, template_kwargs=kwargs)

            # The renderer mirrors only its config's template fields; other kwargs reach the
            # template (renders, and bridges through the template bridge).
            self.renderer = make({k: v for k, v in self.template_kwargs.items() if k in allowed})
            self._renderers = RendererCache(make, allowed, self.template_kwargs, self.renderer)
            self._bridge = RendererBridge(
                self.renderer,
                renderer_for=self._renderers,
                fallback=template_bridge,
                control=self.control,
                template_kwargs=self.template_kwargs,
            )
        else:
            self.renderer = _generic_renderer(tokenizer, template_kwargs)
            self._renderers = None
            self._bridge = template_bridge or GenericBridge(
                tokenizer, template_kwargs=self.template_kwargs, encoder=fast, control=self.control, vision=vision
            )
        self._stop_ids = frozenset(self.renderer.get_stop_token_ids())
        self._markers = marker_ids(tokenizer)  # reasoning and tool-call marker ids
        self._starts_in_reasoning: bool | None = None
        self._starts_in_reasoning_by_kwargs: dict[str, bool] = {}
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

    def starts_in_reasoning_for(self, template_kwargs: dict[str, Any] | None = None) -> bool:
        """``starts_in_reasoning`` under a request's chat-template kwargs (e.g. a template that
        prefills ``<think>`` unless ``enable_thinking`` is false). Probed once per kwargs set."""
        if not template_kwargs:
            return self.starts_in_reasoning
        kwargs = self.merged_template_kwargs(template_kwargs)
        key = repr(sorted(kwargs.items()))
        if key not in self._starts_in_reasoning_by_kwargs:
            if len(self._starts_in_reasoning_by_kwargs) >= 64:  # clients may vary kwargs freely
                self._starts_in_reasoning_by_kwargs.clear()
            # The chat template decides the prompt (a renderer only stands in without one).
            probe_renderer = None if self.template.available else (self._renderers or (lambda _: self.renderer))(kwargs)
            self._starts_in_reasoning_by_kwargs[key] = generation_starts_in_reasoning(
                self.tokenizer, probe_renderer, template_kwargs=kwargs
            )
        return self._starts_in_reasoning_by_kwargs[key]

    def token_bytes(self, ids: list[int]) -> list[bytes]:
        """The exact bytes of each token (for OpenAI's logprob entries)."""
        return token_bytes(self.tokenizer, list(ids))

    def reasoning_token_count(self, output_ids: list[int], *, template_kwargs: dict[str, Any] | None = None) -> int:
        """Output tokens spent in the initial reasoning region, markers included."""
        return reasoning_token_count(
            self.tokenizer, list(output_ids), start_in_reasoning=self.starts_in_reasoning_for(template_kwargs),
            stop_ids=self._stop_ids, markers=self._markers,
        )

    def decoder(self, *, template_kwargs: dict[str, Any] | None = None) -> IncrementalDecoder:
        """A fresh incremental decoder for one streamed output (same boundaries as ``parse``)."""
        return IncrementalDecoder(
            self.tokenizer, start_in_reasoning=self.starts_in_reasoning_for(template_kwargs), stop_ids=self._stop_ids
        )

    def merged_template_kwargs(self, template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
        """A request's chat-template kwargs over the construction-time ones."""
        return {**self.template_kwargs, **(template_kwargs or {})}

    def render(
        self,
        messages: list[Message],
        tools: list[Tool] | None = None,
        *,
        template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Full render of a conversation to prompt ids: the model's chat template, token for token.

        Equals ``tokenizer.apply_chat_template(messages, tools=<nested tools>,
        add_generation_prompt=..., **kwargs)`` except that text spelling a control token is
        encoded as text. ``developer`` messages are ``system`` messages to a template that has
        no developer role.

        Images (messages with image parts): the template writes one ``<|image_pad|>`` per image;
        each is expanded to the image's ``n_tokens`` pads, images in prompt order, as the
        model's processor expands them. ``VisionNotSupported`` without a ``VisionSpec``.
        """
        self.render_calls += 1
        kwargs = self.merged_template_kwargs(template_kwargs)
        images = message_images(messages)
        if images:
            self.check_images()
        if self.template.available:
            msgs = to_renderer_messages(messages, keep_developer=self.template.keeps_developer_role)
            ids = self.template.render_ids(
                msgs, to_template_tools(tools), add_generation_prompt=add_generation_prompt, template_kwargs=kwargs
            )
            return expand_image_pads(ids, images, self.vision.image_pad_id) if images else ids
        renderer = self._renderers(kwargs) if self._renderers is not None else None
        if renderer is None:
            raise ValueError(f"this tokenizer has no chat template and its renderer cannot apply {sorted(kwargs)}")
        return list(
            renderer.render_ids(
                to_renderer_messages(messages), tools=to_renderer_tools(tools), add_generation_prompt=add_generation_prompt
            )
        )

    def check_images(self) -> None:
        """``VisionNotSupported`` unless this model takes images (a ``VisionSpec`` and a chat template)."""
        if self.vision is None:
            raise VisionNotSupported("this model takes text only: it has no image processor (preprocessor_config.json)")
        if not self.template.available:
            raise VisionNotSupported("this tokenizer has no chat template to place images with")

    def renderer_tools(self, tools: list[Tool] | None):
        """Tools in the shape ``self.renderer`` takes (flat for a hand-coded renderer). For a full
        render use ``render``: it is the chat template's, with the nested shape."""
        specs = to_renderer_tools(tools)
        if specs and self.is_generic:
            # apply_chat_template templates expect OpenAI's nested shape.
            return [{"type": "function", "function": s} for s in specs]
        return specs

    def bridge(
        self,
        prev_prompt_ids: Sequence[int],
        prev_output_ids: Sequence[int],
        new_messages: list[Message],
        *,
        tools: list[Tool] | None = None,
        history: list[Message] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> BridgeResult:
        """Ids to append after ``prev_prompt_ids + prev_output_ids``, or a refusal with a reason.

        ``template_kwargs``: the request's chat-template kwargs (merged over the construction
        ones). The bridge honours them or refuses; the previous prompt must have been rendered
        with the same kwargs (a change is a fork: ``template_kwargs_changed``).

        Images in ``new_messages`` are expanded in the returned ids as ``render`` expands them
        (only theirs: the history's images are already in ``prev_prompt_ids``).
        """
        if message_images(new_messages):
            self.check_images()
        return self._bridge.bridge(
            prev_prompt_ids,  # a list or an int32 array: the bridges read its tail only
            as_list(prev_output_ids),
            new_messages,
            tools=tools,
            history=history,
            template_kwargs=self.merged_template_kwargs(template_kwargs),
        )

    def parse(
        self,
        output_ids: list[int],
        *,
        prompt_ids: Sequence[int] | None = None,
        tools: list[Tool] | None = None,
        finish_reason: str = "stop",
        stop_text: str | None = None,
    ) -> ParsedOutput:
        """``stop_text``: the stop string the engine matched; the text ends before it (as OpenAI's
        does) while the recorded ids keep everything that was sampled.

        ``tools``: the tools the request offered; a call naming any other tool (any call when
        the list is empty) comes back as text, flagged ``undeclared_tool``. None: not checked.
        """
        tail = as_list(prompt_ids[-64:]) if prompt_ids is not None and len(prompt_ids) else None  # the assistant header
        declared = None if tools is None else frozenset(t.name for t in tools)
        return parse_output(
            self.renderer, output_ids, prompt_ids=tail, tools=to_renderer_tools(tools), finish_reason=finish_reason,
            stop_text=stop_text, declared=declared,
        )
