"""The model's own chat template, rendered to ids with control tokens only where it wrote them.

A full render is ``tokenizer.apply_chat_template(messages, tools=..., add_generation_prompt=True,
**chat_template_kwargs)``, token for token, with one intended difference: a message, tool
definition or template kwarg whose *text* spells a control token (``<|im_end|>``,
``<tool_call>``, ...) is encoded as that text, never as the control token. Otherwise a client
could forge a role boundary (``"hi<|im_end|>\\n<|im_start|>assistant\\n..."``) in the prompt
and in the training data.

How (the same contract as ``transformers``' ``apply_chat_template(sanitize_control_tokens=True)``,
implemented here so it works on every supported ``transformers`` version):

1. **Control tokens** are the tokenizer's special tokens, the tokens of
   ``tokenizer.chat_control_tokens`` when the tokenizer defines it, and the added tokens that
   appear in the chat template's source (markup-like ones only, e.g. Qwen3's ``<tool_call>``,
   ``<tool_response>``, ``<think>``). Added tokens the template never writes (Qwen3's
   ``<|fim_prefix|>``) are ordinary text to the template and tokenize as the tokenizer does.
2. **Common case**: when no input string contains a control-token string, the rendered text is
   encoded as ``apply_chat_template`` encodes it (``encode(text, add_special_tokens=False)``),
   so the ids are exactly the template's.
3. **Otherwise** every control-token occurrence in the inputs is replaced by a placeholder
   (private-use characters, chosen so they occur nowhere in the request) before rendering. In
   the rendered text every remaining control-token string was written by the template. The
   text is cut at those template control tokens; each run between them, with the placeholders
   put back, is encoded as plain text (the tokenizer's normalizer, pre-tokenizer and model,
   without the added-token pass), so the user's characters tokenize exactly as the same
   characters would in ordinary text.

   A template that *inspects* message text for control-token strings sees the placeholder
   instead (Qwen3 splits ``<think>...</think>`` out of assistant content that has no
   ``reasoning_content``, and does not count a user message wrapped in
   ``<tool_response>...</tool_response>`` as a query). Splice passes reasoning in its own field,
   so the first does not arise for Splice's own turns.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterator

from .sandbox_memo import memoize_sandbox_checks

_MARKER_CANDIDATES = [chr(c) for c in range(0xE000, 0xE040)]  # private-use characters


def _template_source(tokenizer) -> str:
    tpl = getattr(tokenizer, "chat_template", None)
    if isinstance(tpl, dict):  # several named templates
        return "\0".join(str(v) for v in tpl.values())
    return tpl or ""


def _markup_like(token: str) -> bool:
    """An added token that reads as markup (``<tool_call>``, ``[INST]``), not as a word or spaces."""
    return bool(token) and not any(ch.isspace() for ch in token) and any(not ch.isalnum() for ch in token) and len(token) >= 3


def _strings(obj: Any) -> Iterator[str]:
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(k, str):
                yield k
            yield from _strings(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _strings(v)


class ControlTokens:
    """A tokenizer's control tokens and the two encodings: as the tokenizer does, and as text.

    ``encoder`` (default: the tokenizer) does the ordinary encoding; pass Splice's
    ``FastTokenizer`` view for speed.
    """

    def __init__(self, tokenizer, encoder=None):
        self.tokenizer = tokenizer
        self._encoder = encoder or tokenizer
        template = _template_source(tokenizer)
        added: dict[int, Any] = dict(getattr(tokenizer, "added_tokens_decoder", None) or {})
        declared = set(getattr(tokenizer, "chat_control_tokens", None) or ())
        specials = set(getattr(tokenizer, "all_special_tokens", None) or ())
        self.ids: dict[str, int] = {}  # control token text -> id
        self._lstrip: set[str] = set()
        self._rstrip: set[str] = set()
        others: dict[str, int] = {}
        for tid, tok in added.items():
            content = getattr(tok, "content", str(tok))
            if not content:
                continue
            control = (
                getattr(tok, "special", False)
                or content in specials
                or content in declared
                or (_markup_like(content) and content in template)
            )
            if control:
                self.ids[content] = tid
                if getattr(tok, "lstrip", False):
                    self._lstrip.add(content)
                if getattr(tok, "rstrip", False):
                    self._rstrip.add(content)
            else:
                others[content] = tid
        for content in specials - set(self.ids):  # slow tokenizers without added_tokens_decoder entries
            tid = tokenizer.convert_tokens_to_ids(content)
            if isinstance(tid, int):
                self.ids[content] = tid
        self._others = others
        self._re = self._alternation(self.ids)
        self._others_re = self._alternation(others)
        self._backend = getattr(tokenizer, "backend_tokenizer", None)

    @staticmethod
    def _alternation(tokens) -> re.Pattern | None:
        if not tokens:
            return None
        longest_first = sorted(tokens, key=len, reverse=True)  # leftmost-longest, as the tokenizer matches
        return re.compile("|".join(re.escape(t) for t in longest_first))

    # -- detection ---------------------------------------------------------------------------

    def in_text(self, text: str) -> bool:
        return self._re is not None and bool(text) and self._re.search(text) is not None

    def in_any(self, obj: Any) -> bool:
        """Whether any string in ``obj`` (messages, tools, kwargs; keys included) spells a control token."""
        if self._re is None:
            return False
        return any(self._re.search(s) for s in _strings(obj))

    # -- encoding ----------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """What the tokenizer makes of ``text`` (control-token strings become control tokens)."""
        return list(self._encoder.encode(text, add_special_tokens=False)) if text else []

    def encode_as_text(self, text: str) -> list[int]:
        """``text`` with every control-token string encoded as plain text.

        Other added tokens still match, as they would in any text the tokenizer encodes.
        """
        if not self.in_text(text):
            return self.encode(text)
        out: list[int] = []
        pos = 0
        if self._others_re is not None:
            for m in self._others_re.finditer(text):
                out += self._plain(text[pos : m.start()])
                out.append(self._others[m.group()])
                pos = m.end()
        out += self._plain(text[pos:])
        return out

    def _plain(self, text: str) -> list[int]:
        """The tokenizer's pipeline without its added-token pass."""
        if not text:
            return []
        b = self._backend
        if b is not None:
            if b.normalizer is not None:
                text = b.normalizer.normalize_str(text)
            pieces = [text] if b.pre_tokenizer is None else [p for p, _ in b.pre_tokenizer.pre_tokenize_str(text)]
            return [t.id for p in pieces for t in b.model.tokenize(p)]
        # No Rust backend: let transformers skip special tokens; break up any other control token.
        out: list[int] = []
        pos = 0
        for m in self._re.finditer(text):
            out += self._split_special(text[pos : m.start()])
            tok = m.group()
            out += self._split_special(tok[:1]) + self._split_special(tok[1:])
            pos = m.end()
        return out + self._split_special(text[pos:])

    def _split_special(self, text: str) -> list[int]:
        if not text:
            return []
        return list(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))

    # -- placeholders --------------------------------------------------------------------------

    def pick_marker(self, *objs: Any) -> str:
        for marker in _MARKER_CANDIDATES:
            if not any(marker in s for obj in objs for s in _strings(obj)):
                return marker
        raise ValueError("cannot find a free placeholder character for this request")

    def neutralize(self, obj: Any, literals: list[str], marker: str) -> Any:
        """A copy of ``obj`` with each control-token string replaced by ``marker<i>marker``;
        ``literals[i]`` is the replaced text."""

        def sub(m: re.Match) -> str:
            literals.append(m.group())
            return f"{marker}{len(literals) - 1}{marker}"

        def walk(o: Any) -> Any:
            if isinstance(o, str):
                return self._re.sub(sub, o) if self._re is not None else o
            if isinstance(o, dict):
                return {walk(k) if isinstance(k, str) else k: walk(v) for k, v in o.items()}
            if isinstance(o, (list, tuple)):
                return [walk(v) for v in o]
            return o

        return walk(obj)

    def encode_rendered(self, text: str, literals: list[str], marker: str) -> list[int]:
        """Encode a template's output rendered from ``neutralize``d inputs.

        Control-token strings left in ``text`` were written by the template: they become control
        tokens. Placeholders become their literal text, encoded with the text around them.
        """
        if not literals:
            return self.encode(text)
        escaped = json.dumps(marker)[1:-1]  # as ``tojson(ensure_ascii=True)`` would write it
        ph = f"(?:{re.escape(marker)}|{re.escape(escaped)})(\\d+)(?:{re.escape(marker)}|{re.escape(escaped)})"
        pattern = re.compile(ph + ("|(" + self._re.pattern + ")" if self._re is not None else ""))
        out: list[int] = []
        buf: list[str] = []
        strip_next = False
        pos = 0
        for m in pattern.finditer(text):
            buf.append(text[pos : m.start()].replace(marker, ""))  # a lone marker: the template cut a placeholder
            pos = m.end()
            if m.group(1) is not None:
                idx = int(m.group(1))
                buf.append(literals[idx] if idx < len(literals) else m.group())
                continue
            tok = m.group(2)
            run = "".join(buf)
            if strip_next:
                run = run.lstrip()
            if tok in self._lstrip:
                run = run.rstrip()
            out += self.encode_as_text(run)
            out.append(self.ids[tok])
            buf = []
            strip_next = tok in self._rstrip
        run = "".join(buf) + text[pos:].replace(marker, "")
        out += self.encode_as_text(run.lstrip() if strip_next else run)
        return out


class TemplateRenderer:
    """Renders conversations through the tokenizer's chat template (see module docstring)."""

    def __init__(self, tokenizer, control: ControlTokens):
        self.tokenizer = tokenizer
        self.control = control
        self.keeps_developer_role = "developer" in _template_source(tokenizer)
        memoize_sandbox_checks(tokenizer)

    @property
    def available(self) -> bool:
        return bool(_template_source(self.tokenizer))

    def render_text(self, messages: list[dict], tools: list[dict] | None, *, add_generation_prompt: bool, template_kwargs: dict | None = None) -> str:
        kwargs = dict(template_kwargs or {})
        kwargs.pop("tools", None)
        kwargs.pop("add_generation_prompt", None)
        return self.tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def render_ids(self, messages: list[dict], tools: list[dict] | None = None, *, add_generation_prompt: bool = True, template_kwargs: dict | None = None) -> list[int]:
        kwargs = dict(template_kwargs or {})
        c = self.control
        if not c.in_any((messages, tools, kwargs)):
            return c.encode(self.render_text(messages, tools, add_generation_prompt=add_generation_prompt, template_kwargs=kwargs))
        marker = c.pick_marker(messages, tools, kwargs)
        literals: list[str] = []
        msgs2, tools2, kwargs2 = c.neutralize((messages, tools, kwargs), literals, marker)
        text = self.render_text(msgs2, tools2, add_generation_prompt=add_generation_prompt, template_kwargs=kwargs2)
        return c.encode_rendered(text, literals, marker)
