"""Incremental detokenization for streaming: output ids in, ``(channel, text)`` deltas out.

Channels follow Qwen3-style structure tokens, the same boundaries ``tokenization.parse``
uses for the final (authoritative) parse:

- ``reasoning``: inside ``<think> ... </think>``. A ``<think>`` opens reasoning only at the
  start of the output (after whitespace at most); a generation whose prompt already opened
  ``<think>`` starts inside reasoning (``start_in_reasoning=True``). A ``<tool_call>`` before
  ``</think>`` closes reasoning, as the parser does.
- ``content``: the message text.
- ``tool_call``: the text inside ``<tool_call> ... </tool_call>`` blocks. Once the first tool
  call starts, text between blocks is dropped (the parser drops it too).

Stop tokens end the output; anything after them is ignored. Marker ids come from the
tokenizer (``convert_tokens_to_ids``); a tokenizer without them simply has no such channel.

Text is decoded the way vLLM's detokenizer does it: decode a short window of ids and its
prefix, emit the difference, and hold back while the window ends in an incomplete UTF-8
sequence (U+FFFD). The window restarts after each emitted delta, so the cost per token does
not grow with the output length. Deltas of a channel concatenate to the tokenizer's decode
of that channel's ids.
"""

from __future__ import annotations

import json
from typing import Iterable

REASONING = "reasoning"
CONTENT = "content"
TOOL_CALL = "tool_call"

_UFFFD = "\ufffd"


def _token_id(tokenizer, token: str | None) -> int | None:
    if not token:
        return None
    convert = getattr(tokenizer, "convert_tokens_to_ids", None)
    if convert is None:
        return None
    try:
        tid = convert(token)
    except Exception:  # noqa: BLE001 - tokenizers differ in what they raise for unknown tokens
        return None
    if not isinstance(tid, int) or tid < 0 or tid == getattr(tokenizer, "unk_token_id", None):
        return None
    return tid


def default_stop_ids(tokenizer) -> set[int]:
    """The tokenizer's end-of-turn ids: its eos token plus ChatML's ``<|im_end|>`` when present."""
    ids: set[int] = set()
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    for tok in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>"):
        tid = _token_id(tokenizer, tok)
        if tid is not None:
            ids.add(tid)
    return ids


class _Window:
    """Incremental decode of one run of ids (vLLM's prefix/read offset scheme).

    ``_ids[:_read]`` is context (the ids of the last emitted delta), ``_ids[_read:]`` the ids
    not yet emitted. The context makes the next decode see a correct boundary (SentencePiece
    drops a leading space when decoding from the first token).
    """

    __slots__ = ("_tok", "_ids", "_read", "_prefix_text")

    def __init__(self, tokenizer):
        self._tok = tokenizer
        self._ids: list[int] = []
        self._read = 0
        self._prefix_text = ""  # decode of self._ids[:self._read]

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False) if ids else ""

    def push(self, tid: int) -> str:
        self._ids.append(tid)
        text = self._decode(self._ids)
        if len(text) <= len(self._prefix_text) or text.endswith(_UFFFD):
            return ""  # nothing new yet, or a multi-byte character is still incomplete
        delta = text[len(self._prefix_text):]
        self._ids = self._ids[self._read:]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return delta

    def flush(self) -> str:
        """Emit whatever is held (incomplete bytes decode to U+FFFD, as a full decode would)."""
        text = self._decode(self._ids) if len(self._ids) > self._read else ""
        delta = text[len(self._prefix_text):] if len(text) > len(self._prefix_text) else ""
        self._ids = []
        self._read = 0
        self._prefix_text = ""
        return delta


class IncrementalDecoder:
    """Feed output ids as they arrive; get ``(channel, text_delta)`` events.

    ``stop_ids`` defaults to the renderer-independent end-of-turn ids of the tokenizer.
    ``token_counts`` counts the ids seen per channel (markers count toward the channel they
    open or close; ids after a stop token and ignored ids count toward ``"other"``).
    """

    def __init__(
        self,
        tokenizer,
        *,
        start_in_reasoning: bool = False,
        stop_ids: Iterable[int] | None = None,
        think_open: str | None = "<think>",
        think_close: str | None = "</think>",
        tool_open: str | None = "<tool_call>",
        tool_close: str | None = "</tool_call>",
    ):
        self._tok = tokenizer
        self.stop_ids = set(stop_ids) if stop_ids is not None else default_stop_ids(tokenizer)
        self.think_open_id = _token_id(tokenizer, think_open)
        self.think_close_id = _token_id(tokenizer, think_close)
        self.tool_open_id = _token_id(tokenizer, tool_open)
        self.tool_close_id = _token_id(tokenizer, tool_close)
        self.channel = REASONING if start_in_reasoning else CONTENT
        self.reasoning_done = False  # the initial reasoning region has closed
        self.stopped = False
        self.in_tool_section = False  # a tool call has started; text between blocks is dropped
        self._in_block = False
        self._content_blank = True  # no non-whitespace content yet (a <think> may still open reasoning)
        self._window = _Window(tokenizer)
        self.tool_call_texts: list[str] = []  # raw text of each tool-call block (closed or open)
        self.token_counts: dict[str, int] = {REASONING: 0, CONTENT: 0, TOOL_CALL: 0, "other": 0}

    # -- internals -------------------------------------------------------------------------
    def _emit(self, out: list[tuple[str, str]], channel: str, text: str) -> None:
        if not text:
            return
        if channel == CONTENT and self._content_blank and text.strip():
            self._content_blank = False
        if channel == TOOL_CALL:
            self.tool_call_texts[-1] += text
        if out and out[-1][0] == channel:
            out[-1] = (channel, out[-1][1] + text)
        else:
            out.append((channel, text))

    def _flush(self, out: list[tuple[str, str]]) -> None:
        text = self._window.flush()
        if self.channel == TOOL_CALL and not self._in_block:
            return  # between tool-call blocks: dropped
        self._emit(out, self.channel, text)

    def _step(self, tid: int, out: list[tuple[str, str]]) -> None:
        if self.stopped:
            self.token_counts["other"] += 1
            return
        if tid in self.stop_ids:
            self._flush(out)
            self.stopped = True
            self.token_counts["other"] += 1
            return
        ch = self.channel
        if ch == CONTENT:
            if tid == self.think_open_id and not self.reasoning_done and self._content_blank and not self.in_tool_section:
                self._flush(out)
                self.channel = REASONING
                self.token_counts[REASONING] += 1
                return
            if tid == self.tool_open_id and self.tool_open_id is not None:
                self._flush(out)
                self._open_block()
                return
        elif ch == REASONING:
            if tid == self.think_close_id and self.think_close_id is not None:
                self._flush(out)
                self.token_counts[REASONING] += 1
                self.channel = CONTENT
                self.reasoning_done = True
                return
            if tid == self.tool_open_id and self.tool_open_id is not None:
                self._flush(out)
                self.reasoning_done = True
                self._open_block()
                return
            if tid == self.think_open_id:
                self.token_counts[REASONING] += 1
                return  # the parser drops openers inside reasoning
        else:  # TOOL_CALL section
            if self._in_block and tid == self.tool_close_id:
                self._flush(out)
                self._in_block = False
                self.token_counts[TOOL_CALL] += 1
                return
            if not self._in_block:
                if tid == self.tool_open_id:
                    self._window.flush()
                    self._open_block()
                else:
                    self.token_counts["other"] += 1
                return
        self.token_counts[ch] += 1
        self._emit(out, ch, self._window.push(tid))

    def _open_block(self) -> None:
        self.channel = TOOL_CALL
        self.in_tool_section = True
        self._in_block = True
        self.tool_call_texts.append("")
        self.token_counts[TOOL_CALL] += 1

    # -- API -------------------------------------------------------------------------------
    def feed(self, ids: Iterable[int]) -> list[tuple[str, str]]:
        """Consume new output ids; return the text deltas they complete, in order.

        Consecutive deltas of one channel are merged into one event.
        """
        out: list[tuple[str, str]] = []
        for tid in ids:
            self._step(int(tid), out)
        return out

    def finish(self) -> list[tuple[str, str]]:
        """End of output: emit text held back for an incomplete character."""
        out: list[tuple[str, str]] = []
        self._flush(out)
        return out


class StrippedText:
    """Streams a text whose final value is ``full.strip()`` without ever retracting a delta.

    Leading whitespace is dropped; trailing whitespace is held until more non-whitespace
    text follows. ``sent`` is everything emitted so far.
    """

    __slots__ = ("sent", "_pending", "_started")

    def __init__(self) -> None:
        self.sent = ""
        self._pending = ""
        self._started = False

    def push(self, text: str) -> str:
        if not text:
            return ""
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        combined = self._pending + text
        body = combined.rstrip()
        self._pending = combined[len(body):]
        self.sent += body
        return body

    def remainder(self, final: str) -> str | None:
        """What still has to be sent so the deltas add up to ``final``; ``None`` if they cannot."""
        if final.startswith(self.sent):
            return final[len(self.sent):]
        return None


def marker_ids(tokenizer, think_open: str = "<think>", think_close: str = "</think>", tool_open: str = "<tool_call>") -> tuple:
    """The ids of the reasoning and tool-call markers (None where the tokenizer has no such token)."""
    return _token_id(tokenizer, think_open), _token_id(tokenizer, think_close), _token_id(tokenizer, tool_open)


def reasoning_token_count(
    tokenizer,
    output_ids: list[int],
    *,
    start_in_reasoning: bool = False,
    stop_ids: Iterable[int] | None = None,
    think_open: str = "<think>",
    think_close: str = "</think>",
    tool_open: str = "<tool_call>",
    markers: tuple | None = None,
) -> int:
    """Output tokens spent in the initial reasoning region, markers included.

    Same boundaries as ``IncrementalDecoder``, found from ids alone (only the text before a
    ``<think>`` is decoded, to check it is whitespace). ``markers``: ``marker_ids(tokenizer)``,
    when the caller keeps them.
    """
    if not output_ids or tokenizer is None:
        return 0
    open_id, close_id, tool_id = markers or marker_ids(tokenizer, think_open, think_close, tool_open)
    stops = set(stop_ids) if stop_ids is not None else default_stop_ids(tokenizer)
    n = next((i for i, t in enumerate(output_ids) if t in stops), len(output_ids))
    if start_in_reasoning:
        start = 0
    else:
        start = output_ids.index(open_id, 0, n) if open_id is not None and open_id in output_ids[:n] else -1
        # (nothing to decode when the output opens with ``<think>``, the usual case)
        if start < 0 or (start and tokenizer.decode(output_ids[:start], skip_special_tokens=False).strip()):
            return 0
    for i in range(start, n):
        t = output_ids[i]
        if t == close_id and close_id is not None:
            return i - start + 1
        if t == tool_id and tool_id is not None:
            return i - start
    return n - start


# -- token bytes (for logprobs) ---------------------------------------------------------------

def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte <-> unicode map used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}
_BYTE_LEVEL_CACHE: dict[int, bool] = {}


def _is_byte_level(tokenizer) -> bool:
    key = id(tokenizer)
    if key not in _BYTE_LEVEL_CACHE:
        result = False
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            try:
                decoder = backend.decoder
                dec = json.loads(decoder.__getstate__()) if decoder is not None else {}
                kinds = [dec.get("type")] + [d.get("type") for d in dec.get("decoders", []) or []]
                result = "ByteLevel" in kinds
            except Exception:  # noqa: BLE001
                result = False
        elif getattr(tokenizer, "byte_decoder", None) is not None:
            result = True
        _BYTE_LEVEL_CACHE[key] = result
    return _BYTE_LEVEL_CACHE[key]


def token_bytes(tokenizer, token_ids: list[int]) -> list[bytes]:
    """The exact bytes of each token (byte-level BPE), else the UTF-8 of its decode."""
    if _is_byte_level(tokenizer):
        pieces = tokenizer.convert_ids_to_tokens(list(token_ids))
        out: list[bytes] = []
        for tid, piece in zip(token_ids, pieces):
            if piece is not None and all(ch in _BYTE_DECODER for ch in piece):
                out.append(bytes(_BYTE_DECODER[ch] for ch in piece))
            else:
                out.append(tokenizer.decode([tid], skip_special_tokens=False).encode("utf-8"))
        return out
    return [tokenizer.decode([tid], skip_special_tokens=False).encode("utf-8") for tid in token_ids]


# -- where generation starts ------------------------------------------------------------------

def generation_starts_in_reasoning(tokenizer, renderer=None, *, template_kwargs: dict | None = None) -> bool:
    """Whether the chat template's generation prompt leaves a ``<think>`` open.

    Qwen3's hybrid template does not (the model emits ``<think>`` itself); templates that
    prefill ``<think>\\n`` do. Probed once by rendering a one-message conversation.
    """
    try:
        from renderers.reasoning import prompt_ends_in_reasoning

        probe = [{"role": "user", "content": "x"}]
        if renderer is not None:
            ids = list(renderer.render(probe, add_generation_prompt=True).token_ids)
            stop = set(renderer.get_stop_token_ids())
        else:
            ids = tokenizer.apply_chat_template(
                probe, add_generation_prompt=True, tokenize=True, **(template_kwargs or {})
            )
            if isinstance(ids, dict):
                ids = ids["input_ids"]
            stop = default_stop_ids(tokenizer)
        return bool(prompt_ends_in_reasoning(tokenizer, list(ids), stop_ids=stop))
    except Exception:  # noqa: BLE001 - a template that cannot be probed streams as content first
        return False


class StopTextFilter:
    """Streams text but never a stop string: text that may begin one is held back, and
    everything from a match on is dropped (the engine stopped there; OpenAI omits it)."""

    def __init__(self, stops: Iterable[str] = ()):
        self.stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._buf = ""
        self.matched = False

    def push(self, text: str) -> str:
        if self.matched:
            return ""
        if not self.stops:
            return text
        self._buf += text
        hits = [i for i in (self._buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self._buf, self.matched = self._buf[: min(hits)], "", True
            return out
        keep = 0
        for k in range(min(self._hold, len(self._buf)), 0, -1):
            tail = self._buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                keep = k
                break
        out = self._buf[: len(self._buf) - keep]
        self._buf = self._buf[len(out) :]
        return out

    def flush(self) -> str:
        out, self._buf = ("" if self.matched else self._buf), ""
        return out
