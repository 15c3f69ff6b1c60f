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
    long = "word " * 40  # above the short memo's limit: kept as a segment instead, same ids
    assert fast.encode(long) == qwen_tok.encode(long, add_special_tokens=False) and long not in fast._memo
    again = fast.encode(long)
    again.append(-1)
    assert fast.encode(long) == qwen_tok.encode(long, add_special_tokens=False)


_PIECES = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "<|endoftext|>", "\n", " ", "  ", "\n\n",
           "system", "You are a coding agent.", '{"name": "bash", "arguments": {"cmd": "ls -la"}}', "caf\u00e9 \u4f60\u597d",
           "\U0001f600", "e\u0301", "<|im_start", "im_end|>", "\t", "123456789", " ."]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(st.sampled_from(_PIECES) | st.text(max_size=12), min_size=8, max_size=60))
def test_long_text_split_at_added_tokens_equals_transformers_encode(qwen_tok, parts):
    """Text above the short memo's limit is encoded piece by piece between added tokens, each
    piece remembered: the ids must be transformers' own for the whole text, the first time and
    from the memo, whatever sits next to an added token."""
    text = "x" * 65 + "".join(parts)  # always the long path
    fast = FastTokenizer(qwen_tok)
    assert fast._split is not None
    want = qwen_tok.encode(text, add_special_tokens=False)
    assert fast.encode(text) == want
    assert fast.encode(text) == want  # from the segment memo


def test_a_system_prompt_is_encoded_once_across_sessions(qwen_tok):
    fast = FastTokenizer(qwen_tok)
    system = "You are a careful agent. " * 200
    first = f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\nfix the bug<|im_end|>\n<|im_start|>assistant\n"
    second = first.replace("fix the bug", "add a test")
    assert fast.encode(first) == qwen_tok.encode(first, add_special_tokens=False)
    calls = []
    backend = fast._backend
    fast._backend = type("Counting", (), {"encode": lambda self, t, **kw: calls.append(t) or backend.encode(t, **kw)})()
    assert fast.encode(second) == qwen_tok.encode(second, add_special_tokens=False)
    assert all(system not in c for c in calls) and any("add a test" in c for c in calls)


def test_renderer_on_the_fast_view_renders_the_same_ids(qwen_tok):
    """The hand-coded renderer (bridges, parsing) gives the same ids on the fast view."""
    from renderers import Qwen3RendererConfig, create_renderer

    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "Caf\u00e9 \U0001f600 <|im_end|>"}]
    kw = dict(tools=[{"name": "f", "description": "d", "parameters": {"type": "object", "properties": {}}}], add_generation_prompt=True)
    plain = create_renderer(qwen_tok, Qwen3RendererConfig()).render_ids(msgs, **kw)
    assert create_renderer(FastTokenizer(qwen_tok), Qwen3RendererConfig()).render_ids(msgs, **kw) == plain
    assert isinstance(ChatFormat(qwen_tok, "qwen3").renderer._tokenizer, FastTokenizer)
    assert not callable(getattr(FastTokenizer(qwen_tok), "__call__", None))


_SPECIAL = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<|endoftext|>"]


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(0, 151_668) | st.sampled_from([151644, 151645, 151667, 151668, 198, 271]), max_size=6),
       skip=st.sampled_from([None, False, True]))  # fmt: skip
def test_memoised_decode_equals_transformers_decode(qwen_tok, ids, skip):
    """Short id runs are decoded once and remembered: the text must be transformers' own, the
    first time and from the memo, with and without ``skip_special_tokens``."""
    fast = FastTokenizer(qwen_tok)
    kw = {} if skip is None else {"skip_special_tokens": skip}
    for _ in range(2):
        assert fast.decode(list(ids), **kw) == qwen_tok.decode(list(ids), **kw)


def test_memoised_token_ids_equal_transformers(qwen_tok):
    fast = FastTokenizer(qwen_tok)
    for _ in range(2):
        for token in [*_SPECIAL, "hello", "\u0120the", "not-a-token-xyz"]:
            assert fast.convert_tokens_to_ids(token) == qwen_tok.convert_tokens_to_ids(token)
        assert fast.convert_tokens_to_ids(_SPECIAL) == qwen_tok.convert_tokens_to_ids(_SPECIAL)
    assert "<think>" in fast._token_ids  # asked twice, looked up once


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(0, 151_668) | st.sampled_from([151644, 151645, 151667, 151668, 198, 271]), min_size=5,
                    max_size=80),
       skip=st.sampled_from([None, False, True]))  # fmt: skip
def test_backend_decode_equals_transformers_decode(qwen_tok, ids, skip):
    """Runs longer than the memo's go straight to the Rust backend: the text must be
    transformers' own (a partial UTF-8 sequence, special tokens kept or skipped)."""
    fast = FastTokenizer(qwen_tok)
    assert fast._decoder is not None
    kw = {} if skip is None else {"skip_special_tokens": skip}
    assert fast.decode(list(ids), **kw) == qwen_tok.decode(list(ids), **kw)


def test_decode_of_ids_that_are_not_plain_ints_falls_back_to_transformers(qwen_tok):
    import numpy as np

    fast = FastTokenizer(qwen_tok)
    ids = qwen_tok.encode("a tool call: <tool_call>\n{}\n</tool_call> done", add_special_tokens=False)
    as_numpy = [np.int64(i) for i in ids]
    assert fast.decode(as_numpy) == qwen_tok.decode(ids)
    assert fast.decode(np.asarray(ids)) == qwen_tok.decode(ids)


def test_a_tokenizer_that_cleans_up_spaces_decodes_through_transformers(qwen_tok):
    import copy

    tok = copy.deepcopy(qwen_tok)
    tok.clean_up_tokenization_spaces = True  # transformers' wrapper does more than the backend here
    assert FastTokenizer(tok)._decoder is None


def test_special_token_attributes_are_the_tokenizers_and_read_from_it_once(qwen_tok):
    fast = FastTokenizer(qwen_tok)
    names = [f"{k}_token{s}" for k in ("unk", "eos", "bos", "pad") for s in ("", "_id")]
    assert [getattr(fast, n) for n in names] == [getattr(qwen_tok, n) for n in names]
    reads = []

    class Counting:
        def __getattr__(self, name):
            reads.append(name)
            return getattr(qwen_tok, name)

    fast._tok = Counting()
    assert [getattr(fast, n) for n in names] == [getattr(qwen_tok, n) for n in names]  # kept: no read
    assert fast.model_max_length == qwen_tok.model_max_length  # anything else: read through each time
    assert fast.model_max_length == qwen_tok.model_max_length
    assert reads == ["model_max_length", "model_max_length"]


def test_long_text_is_encoded_with_the_gil_released_and_the_same_ids(qwen_tok):
    """A long piece (a tool result, a pasted file) goes through ``encode_batch``, which lets go of
    the GIL while the Rust code runs; ``encode`` held it (2 MB: 3 s with every other thread, the
    event loop included, stopped). The ids are transformers' own either way."""
    import threading
    import time

    from tokenization.fast_tokenizer import RELEASE_GIL_CHARS

    fast = FastTokenizer(qwen_tok)
    piece = " ".join(f"w{i} café {i * 7}" for i in range(4_000))
    assert len(piece) > RELEASE_GIL_CHARS
    text = f"<|im_start|>user\n{piece}<|im_end|>\n" + piece[::-1]  # split at added tokens: long pieces on both sides
    assert fast.encode(text) == qwen_tok.encode(text, add_special_tokens=False)

    big = " ".join(f"word{i}" for i in range(120_000))  # ~1 MB: about a second of tokenizing
    done, ticks = threading.Event(), 0
    worker = threading.Thread(target=lambda: (fast.encode(big), done.set()))
    worker.start()
    while not done.is_set():
        time.sleep(0.005)
        ticks += 1
    worker.join()
    assert ticks >= 20, ticks  # holding the GIL, this thread woke 1 to 3 times in the whole encode
