"""Output text as the real servers show it: decoded ids, stop strings trimmed, partial characters held back.

Token ids are never changed here; text is a view of them. While a stream is running the
visible text is always a prefix of the final text, so cumulative (SGLang) and delta (vLLM)
frames stay consistent.
"""

from __future__ import annotations

from .generator import Finish


def decode(tokenizer, ids: list[int], *, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True) -> str:
    if not ids:
        return ""
    return tokenizer.decode(
        ids,
        skip_special_tokens=skip_special_tokens,
        spaces_between_special_tokens=spaces_between_special_tokens,
    )


def output_text(
    tokenizer,
    ids: list[int],
    finish: Finish | None,
    *,
    skip_special_tokens: bool = True,
    spaces_between_special_tokens: bool = True,
    trim_stop_str: bool = True,
    trim_stop_token: bool = False,
    stop: tuple[str, ...] = (),
) -> str:
    """The text of ``ids``; ``finish is None`` means the generation is still running.

    ``trim_stop_str``: cut the text where the matched stop string begins (SGLang without
    ``no_stop_trim``, vLLM without ``include_stop_str_in_output``). ``trim_stop_token``: leave
    the matched stop token out of the text (SGLang without ``no_stop_trim``).
    """
    if finish is not None and finish.type == "stop" and isinstance(finish.matched, int) and trim_stop_token and ids:
        ids = ids[:-1]
    text = decode(tokenizer, ids, skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=spaces_between_special_tokens)
    if finish is None:
        text = text.rstrip("\ufffd")  # an incomplete UTF-8 character: wait for its next byte
        if trim_stop_str and stop:
            hold = max(len(s) for s in stop) - 1  # the start of a stop string may be on screen
            if hold > 0:
                text = text[: max(0, len(text) - hold)]
        return text
    if finish.type == "stop" and isinstance(finish.matched, str) and trim_stop_str:
        cut = text.find(finish.matched)
        if cut >= 0:
            text = text[:cut]
    return text
