from hypothesis import given, settings
from hypothesis import strategies as st

from tokenization import ChatFormat
from tokenization.fast_tokenizer import FastTokenizer


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=60) | st.sampled_from(["<|im_end|>x", "a<tool_call>b", " \n\n.", "e\u0301"]))
def test_backend_encode_equals_transformers_encode(qwen_tok, text):
    fast = FastTokenizer(qwen_tok)
    assert fast._backend is not None
    assert fast.encode(text, add_special_tokens=False) == qwen_tok.encode(text, add_special_tokens=False)
    assert fast.encode(text) == qwen_tok.encode(text, add_special_tokens=False)  # the memo's answer, second time


def test_memoised_short_strings_come_back_as_fresh_lists(qwen_tok):
    fast = FastTokenizer(qwen_tok)
    first = fast.encode("<think>\n")
    first.append(-1)  # a caller extending what it got must not change the next answer
    assert fast.encode("<think>\n") == qwen_tok.encode("<think>\n", add_special_tokens=False)
    long = "word " * 40  # above the memo's limit: encoded each time, same ids
    assert fast.encode(long) == qwen_tok.encode(long, add_special_tokens=False) and long not in fast._memo


def test_renderer_on_the_fast_view_renders_the_same_ids(qwen_tok):
    """The hand-coded renderer (bridges, parsing) gives the same ids on the fast view."""
    from renderers import Qwen3RendererConfig, create_renderer

    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "Caf\u00e9 \U0001f600 <|im_end|>"}]
    kw = dict(tools=[{"name": "f", "description": "d", "parameters": {"type": "object", "properties": {}}}], add_generation_prompt=True)
    plain = create_renderer(qwen_tok, Qwen3RendererConfig()).render_ids(msgs, **kw)
    assert create_renderer(FastTokenizer(qwen_tok), Qwen3RendererConfig()).render_ids(msgs, **kw) == plain
    assert isinstance(ChatFormat(qwen_tok, "qwen3").renderer._tokenizer, FastTokenizer)
    assert not callable(getattr(FastTokenizer(qwen_tok), "__call__", None))
