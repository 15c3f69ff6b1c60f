import pytest

from tokenization import ChatFormat, load_tokenizer, qwen3_tokenizer_dir

# A Llama-3-style template (header tokens, blank line, end-of-turn token) that no hand-coded
# renderer covers, written with special tokens the Qwen3 vocabulary has.
LLAMA_STYLE_TEMPLATE = (
    "{%- if tools %}<|box_start|>system<|box_end|>\n\nTools:\n"
    "{%- for t in tools %}{{ t | tojson }}\n{%- endfor %}<|endoftext|>{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|box_start|>ipython<|box_end|>\n\n{{ m.content }}<|endoftext|>"
    "{%- elif m.role == 'assistant' %}<|box_start|>assistant<|box_end|>\n\n{{ m.content }}"
    "{%- if m.tool_calls %}{%- for tc in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}{%- endif %}<|endoftext|>"
    "{%- else %}<|box_start|>{{ m.role }}<|box_end|>\n\n{{ m.content }}<|endoftext|>{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|box_start|>assistant<|box_end|>\n\n{% endif %}"
)


@pytest.fixture(scope="session")
def qwen_tok():
    return load_tokenizer(str(qwen3_tokenizer_dir()))


@pytest.fixture(scope="session")
def qwen3(qwen_tok):
    return ChatFormat(qwen_tok, "qwen3")


@pytest.fixture(scope="session")
def llama_style_tok():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir()))
    tok.chat_template = LLAMA_STYLE_TEMPLATE
    tok.eos_token = "<|endoftext|>"
    return tok


@pytest.fixture(scope="session")
def generic(llama_style_tok):
    return ChatFormat(llama_style_tok, None)
