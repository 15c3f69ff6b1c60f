from hypothesis import given, settings
from hypothesis import strategies as st

from tokenization import ChatFormat, Message, Tool
from tokenization.fast_tokenizer import FastTokenizer


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=60) | st.sampled_from(["<|im_end|>x", "a<tool_call>b", " \n\n.", "e\u0301"]))
def test_backend_encode_equals_transformers_encode(qwen_tok, text):
    fast = FastTokenizer(qwen_tok)
    assert fast._backend is not None
    assert fast.encode(text, add_special_tokens=False) == qwen_tok.encode(text, add_special_tokens=False)


def test_renderer_on_the_fast_view_renders_the_same_ids(qwen_tok):
    from renderers import Qwen3RendererConfig, create_renderer

    msgs = [Message("system", "s"), Message("user", "Caf\u00e9 \U0001f600 <|im_end|>")]
    tools = [Tool("f", "d", {"type": "object", "properties": {}})]
    plain = create_renderer(qwen_tok, Qwen3RendererConfig()).render_ids(
        [{"role": m.role, "content": m.content} for m in msgs],
        tools=[{"name": "f", "description": "d", "parameters": {"type": "object", "properties": {}}}],
        add_generation_prompt=True,
    )
    assert ChatFormat(qwen_tok, "qwen3").render(msgs, tools) == plain
    assert not callable(getattr(FastTokenizer(qwen_tok), "__call__", None))
