"""Control-token text: encoded as text, and nothing else changes (real Qwen3 tokenizer)."""

from __future__ import annotations

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tokenization import Message, Tool
from tokenization.template import ControlTokens

CONTROL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

plain_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
pieces = st.lists(st.one_of(plain_text, st.sampled_from(CONTROL + ["<|im_", "end|>", "\n", " ", "<|fim_prefix|>"])), max_size=6)
texts = pieces.map("".join)


def test_control_set_is_the_specials_plus_what_the_template_writes(qwen_tok):
    c = ControlTokens(qwen_tok)
    assert set(CONTROL) <= set(c.ids)
    # Added tokens the Qwen3 template never writes stay ordinary added tokens.
    assert "<|fim_prefix|>" not in c.ids and "<|file_sep|>" not in c.ids


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=texts)
@example(text="<|video_pad|>")  # a special token outside CONTROL: encoded as text as well
def test_encode_as_text_has_no_control_token_and_decodes_back(qwen_tok, text):
    c = ControlTokens(qwen_tok)
    ids = c.encode_as_text(text)
    assert not set(ids) & set(c.ids.values())
    assert qwen_tok.decode(ids) == qwen_tok.decode(qwen_tok.encode(text, add_special_tokens=False))
    # The tokenizer's own special tokens (``<|video_pad|>`` and the like) are control tokens too.
    special = {t.content for t in qwen_tok.added_tokens_decoder.values() if t.special}
    if not any(t in text for t in [*CONTROL, *special]):
        assert ids == qwen_tok.encode(text, add_special_tokens=False)  # nothing else changes


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(user=texts, tool=texts, reasoning=texts, desc=texts)
def test_render_keeps_control_text_as_text(qwen3, qwen_tok, user, tool, reasoning, desc):
    """Whatever the texts, the control tokens of a render are exactly the template's own."""
    tools = [Tool("f", desc, {"type": "object", "properties": {}})]

    def conv(u, t, r):
        return [
            Message("user", u),
            Message("assistant", "", reasoning=r or None, tool_calls=()),
            Message("user", "next"),
            Message("assistant", "x", reasoning=r or None),
            Message("tool", t, tool_call_id="c"),
        ]

    ids = qwen3.render(conv(user, tool, reasoning), tools)
    clean = qwen3.render(conv("u" if user else "", "t" if tool else "", "r" if reasoning else ""), [Tool("f", "d" if desc else "", {"type": "object", "properties": {}})])
    for name in CONTROL:
        tid = qwen_tok.convert_tokens_to_ids(name)
        assert ids.count(tid) == clean.count(tid), name
    msgs = [
        {"role": m.role, "content": m.content, **({"reasoning_content": m.reasoning} if m.reasoning else {})}
        for m in conv(user, tool, reasoning)
    ]
    plain = qwen_tok.apply_chat_template(
        msgs, tools=[{"type": "function", "function": {"name": "f", "description": desc, "parameters": {"type": "object", "properties": {}}}}],
        add_generation_prompt=True, tokenize=True, return_dict=False,
    )
    if not any(t in s for s in (user, tool, reasoning, desc) for t in CONTROL):
        assert ids == list(plain)
    else:
        assert qwen_tok.decode(ids) == qwen_tok.decode(list(plain))
