"""A thin tokenizer view for the hot path: encode straight through the Rust backend.

``transformers``' ``encode`` spends most of its time in Python bookkeeping, and the
`renderers` package probes any callable tokenizer for character offsets on every text segment
(to attribute template scaffold vs. content, which Splice does not use). This view exposes the
plain ``Tokenizer`` protocol only (no ``__call__``), so renderers take their one-pass
``encode`` path; the ids are the same.
"""

from __future__ import annotations

import re
from array import array
from typing import Any

MEMO_MAX_CHARS = 64  # strings this short recur: role headers, think / tool-call markers, "\n"
MEMO_ENTRIES = 4096
SHORT_DECODE = 4  # id runs this short recur when decoded: markers, newlines, single tokens
# Text longer than this is encoded through ``encode_batch``, which releases the GIL while the Rust
# code runs (``encode`` holds it: 3 s for 2 MB, with the event loop stalled behind a worker thread).
RELEASE_GIL_CHARS = 16_384
SEGMENT_MEMO_CHARS = 2_000_000  # longer text between control tokens: system prompts and tool lists recur

_SPECIAL_TOKEN_ATTRS = frozenset(
    f"{kind}_token{suffix}" for kind in ("unk", "eos", "bos", "pad") for suffix in ("", "_id")
)

_PROBES = (
    "hello world", "Hello.\n\n", '{"a": false}', "e\u0301 caf\u00e9 \u4f60\u597d \U0001f600",
    "<|im_start|>user\nhi<|im_end|>\n", "  spaces\tand\ttabs  ", "<tool_call>\n{}\n</tool_call>",
)


class FastTokenizer:
    """Wraps a Hugging Face tokenizer; ``encode`` uses the backend when it agrees on probes."""

    def __init__(self, tokenizer: Any):
        self._tok = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = None
        if backend is not None:
            try:
                if all(backend.encode(p, add_special_tokens=False).ids == tokenizer.encode(p, add_special_tokens=False) for p in _PROBES):
                    self._backend = backend
            except Exception:
                self._backend = None
        # The renderers encode the same short scaffold strings several times per turn (each
        # reasoning scan encodes "<think>"); a call into the Rust backend costs microseconds,
        # a dict hit a fraction of one. Bounded: cleared when full.
        self._memo: dict[str, tuple[int, ...]] = {}
        # Long text is encoded piece by piece between added tokens (the backend splits there
        # first, so the ids are the same) and each piece is remembered: a fleet's sessions
        # open with the same system prompt and tool list, encoded once instead of per session.
        self._segments: dict[str, array] = {}
        self._segment_chars = 0
        self._split: re.Pattern | None = None
        self._added: dict[str, int] = {}
        if self._backend is not None:
            self._split_at_added_tokens()
        # Token strings to ids and short id runs to text: fixed per tokenizer, asked for several
        # times per turn by the renderers' reasoning and header scans (each a slow Python call).
        self._token_ids: dict[str, Any] = {}
        self._texts: dict[tuple, str] = {}
        # Longer id runs (a turn's output, its tool calls, reasoning) decode through the backend
        # too: transformers' ``decode`` around the same Rust call costs twice as much, and the
        # renderers decode several times per turn. Only where the wrapper adds nothing (no
        # clean-up of spaces) and the texts agree on the probes.
        self._decoder = None
        if self._backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
            try:
                probes = [self._backend.encode(p, add_special_tokens=False).ids for p in _PROBES]
                if all(self._backend.decode(ids, skip_special_tokens=skip) == tokenizer.decode(ids, skip_special_tokens=skip)
                       for ids in probes for skip in (False, True)):  # fmt: skip
                    self._decoder = self._backend
            except Exception:
                self._decoder = None

    @property
    def wrapped(self) -> Any:
        return self._tok

    def encode(self, text: str, *args: Any, add_special_tokens: bool = False, **kwargs: Any) -> list[int]:
        if self._backend is not None and not args and not kwargs and not add_special_tokens:
            if len(text) > MEMO_MAX_CHARS:
                return self._encode_long(text)
            ids = self._memo.get(text)
            if ids is None:
                if len(self._memo) >= MEMO_ENTRIES:
                    self._memo.clear()
                ids = self._memo[text] = tuple(self._backend.encode(text, add_special_tokens=False).ids)
            return list(ids)  # a fresh list: callers may extend it
        return self._tok.encode(text, *args, add_special_tokens=add_special_tokens, **kwargs)

    def _split_at_added_tokens(self) -> None:
        """Encode long text piece by piece between added tokens, when splitting there is exact:
        every added token matched verbatim (no strip, normalisation or word rule) and the probes
        agree; otherwise whole, as before."""
        decoder = getattr(self._tok, "added_tokens_decoder", None) or {}
        tokens = {t.content: i for i, t in decoder.items()}
        plain = all(not (t.lstrip or t.rstrip or t.normalized or t.single_word) for t in decoder.values())
        if not tokens or not plain:
            return
        self._split = re.compile("(" + "|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)) + ")")
        self._added = tokens
        probes = [p * 3 for p in _PROBES] + ["".join(_PROBES) + "<|im_start|>" + "x" * 100 + "<|im_end|>"]
        if any(self._encode_long(p) != self._backend.encode(p, add_special_tokens=False).ids for p in probes):
            self._split, self._added = None, {}
            self._segments.clear()
            self._segment_chars = 0

    def _backend_ids(self, text: str) -> list[int]:
        if len(text) > RELEASE_GIL_CHARS:  # the same pipeline, one input: the same ids
            return self._backend.encode_batch([text], add_special_tokens=False)[0].ids
        return self._backend.encode(text, add_special_tokens=False).ids

    def _encode_long(self, text: str) -> list[int]:
        if self._split is None:
            return self._backend_ids(text)
        out: list[int] = []
        for k, part in enumerate(self._split.split(text)):
            if k % 2:  # an added token
                out.append(self._added[part])
                continue
            if not part:
                continue
            ids = self._segments.get(part)
            if ids is None:
                ids = array("i", self._backend_ids(part))
                if self._segment_chars + len(part) > SEGMENT_MEMO_CHARS:
                    self._segments.clear()
                    self._segment_chars = 0
                self._segments[part] = ids
                self._segment_chars += len(part)
            out += ids.tolist()
        return out

    def decode(self, token_ids: Any, *args: Any, **kwargs: Any) -> str:
        if args or len(kwargs) > 1 or (kwargs and "skip_special_tokens" not in kwargs) or type(token_ids) is not list:
            return self._tok.decode(token_ids, *args, **kwargs)
        if len(token_ids) > SHORT_DECODE:
            if self._decoder is not None:
                try:
                    return self._decoder.decode(token_ids, skip_special_tokens=kwargs.get("skip_special_tokens", False))
                except (TypeError, OverflowError):  # ids that are not plain ints: transformers converts them
                    pass
            return self._tok.decode(token_ids, **kwargs)
        key = (*token_ids, kwargs.get("skip_special_tokens", False))
        text = self._texts.get(key)
        if text is None:
            if len(self._texts) >= MEMO_ENTRIES:
                self._texts.clear()
            text = self._texts[key] = self._tok.decode(token_ids, **kwargs)
        return text

    def convert_tokens_to_ids(self, tokens: Any) -> Any:
        if type(tokens) is not str:
            return self._tok.convert_tokens_to_ids(tokens)
        ids = self._token_ids.get(tokens)
        if ids is None:
            if len(self._token_ids) >= MEMO_ENTRIES:
                self._token_ids.clear()
            ids = self._token_ids[tokens] = self._tok.convert_tokens_to_ids(tokens)
        return ids

    def __getattr__(self, name: str) -> Any:
        if name == "__call__":  # keep renderers off the per-segment offset probe
            raise AttributeError(name)
        value = getattr(self._tok, name)
        if name in _SPECIAL_TOKEN_ATTRS:
            # Fixed once the tokenizer is loaded, read several times per turn (each reasoning scan
            # compares against ``unk_token_id``) through transformers' slow properties: kept on
            # the view, later reads never reach this method.
            self.__dict__[name] = value
        return value
