from renderers.qwen3 import Qwen3Renderer

from tokenization import ChatFormat, load_tokenizer, qwen3_tokenizer_dir, renderer_name_for


def test_qwen3_tokenizer_loads_offline_and_special_ids_are_pinned(qwen_tok):
    ids = qwen_tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>"])
    assert ids == [151644, 151645, 151657, 151658, 151667, 151668]


def test_renderer_chosen_by_model_name_or_explicit_setting(qwen_tok):
    assert renderer_name_for("Qwen/Qwen3-8B") == "qwen3"
    assert renderer_name_for("Qwen3-8B") == "qwen3"  # a served model name without the org
    # A local folder carries no model name: generic unless --renderer says otherwise.
    assert renderer_name_for(str(qwen3_tokenizer_dir())) is None
    assert renderer_name_for(str(qwen3_tokenizer_dir()), "qwen3") == "qwen3"
    assert renderer_name_for("Qwen/Qwen3-8B", "generic") is None
    assert isinstance(ChatFormat(qwen_tok, "qwen3").renderer, Qwen3Renderer)


def test_load_tokenizer_is_cached():
    a = load_tokenizer(str(qwen3_tokenizer_dir()))
    assert load_tokenizer(str(qwen3_tokenizer_dir())) is a
