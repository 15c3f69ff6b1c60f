"""Each case: a full re-render + re-tokenize changes the ids, the splice keeps the sampled ids.

These are the ways seed 004's 48/48 tool-using turns broke prefix stability.
"""

import json
import unicodedata


from tokenization import Message, Tool, ToolCall

from .helpers import assistant_from, spliced_prompt

TOOLS = [Tool("lookup", "look a thing up", {"type": "object", "properties": {"q": {"type": "string"}, "exact": {"type": "boolean"}}})]


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def check_drift(cf, history, output, new, *, tools=TOOLS, edit=None):
    """Return (spliced, rerendered); assert the splice keeps prompt + output verbatim."""
    prompt = cf.render(history, tools)
    asst = assistant_from(cf, prompt, output)
    if edit is not None:
        asst = edit(asst)
    spliced = spliced_prompt(cf, prompt, output, history + [asst], new, tools)
    assert spliced[: len(prompt) + len(output)] == prompt + output
    rerendered = cf.render(history + [asst] + new, tools)
    return prompt, spliced, rerendered


def first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


HIST = [Message("system", "You are terse."), Message("user", "Say hello.")]
TOOL_RESULT = [Message("tool", "ok", tool_call_id="c0")]
FOLLOW_UP = [Message("user", "Again.")]


def test_non_canonical_bpe_split(qwen3, qwen_tok):
    hel, lo = enc(qwen_tok, "hel"), enc(qwen_tok, "lo")
    assert enc(qwen_tok, "hello") != hel + lo  # the tokenizer would merge them
    output = hel + lo + [qwen_tok.convert_tokens_to_ids("<|im_end|>")]
    prompt, spliced, rerendered = check_drift(qwen3, HIST, output, FOLLOW_UP)
    assert spliced != rerendered
    assert rerendered[len(prompt) : len(prompt) + len(output)] != output


def test_period_then_blank_line_split(qwen3, qwen_tok):
    dot, nn = enc(qwen_tok, "Done."), enc(qwen_tok, "\n\n")
    assert enc(qwen_tok, "Done.\n\nNext") != dot + nn + enc(qwen_tok, "Next")
    output = dot + nn + enc(qwen_tok, "Next") + [qwen_tok.convert_tokens_to_ids("<|im_end|>")]
    _, spliced, rerendered = check_drift(qwen3, HIST, output, FOLLOW_UP)
    assert spliced != rerendered


def test_compact_tool_call_json_reserialized_with_spaces(qwen3, qwen_tok):
    text = '<tool_call>\n{"name":"lookup","arguments":{"q":"x"}}\n</tool_call><|im_end|>'
    output = enc(qwen_tok, text)
    prompt, spliced, rerendered = check_drift(qwen3, HIST, output, TOOL_RESULT)
    assert spliced != rerendered
    assert '{"name": "lookup", "arguments": {"q": "x"}}' in qwen_tok.decode(rerendered[len(prompt) :])
    assert qwen_tok.decode(spliced[len(prompt) : len(prompt) + len(output)]) == text


def test_boolean_false_round_tripped_to_python_false(qwen3, qwen_tok):
    text = '<tool_call>\n{"name": "lookup", "arguments": {"q": "x", "exact": false}}\n</tool_call><|im_end|>'
    output = enc(qwen_tok, text)

    def python_round_trip(asst):  # an agent framework that str()s parsed arguments
        tc = asst.tool_calls[0]
        return Message("assistant", asst.content, reasoning=asst.reasoning,
                       tool_calls=(ToolCall(tc.id, tc.name, str(json.loads(tc.arguments))),))

    prompt, spliced, rerendered = check_drift(qwen3, HIST, output, TOOL_RESULT, edit=python_round_trip)
    assert "False" in qwen_tok.decode(rerendered[len(prompt) :])
    assert "False" not in qwen_tok.decode(spliced[len(prompt) :])


def test_nfc_normalizable_sequence(qwen3, qwen_tok):
    decomposed = "Cafe\u0301"
    assert unicodedata.normalize("NFC", decomposed) != decomposed
    # The model can sample the decomposed form; the tokenizer NFC-normalizes what it encodes.
    output = enc(qwen_tok, "Cafe") + enc(qwen_tok, "\u0301") + [qwen_tok.convert_tokens_to_ids("<|im_end|>")]
    assert qwen_tok.decode(output[:-1]) == decomposed
    assert enc(qwen_tok, decomposed) != output[:-1]
    prompt, spliced, rerendered = check_drift(qwen3, HIST, output, FOLLOW_UP)
    assert spliced != rerendered
    assert spliced[len(prompt) : len(prompt) + len(output)] == output


def test_qwen3_strips_earlier_think_blocks(qwen3, qwen_tok):
    text = "<think>\nThe user wants a greeting.\n</think>\n\nHello!<|im_end|>"
    output = enc(qwen_tok, text)
    prompt, spliced, rerendered = check_drift(qwen3, HIST, output, FOLLOW_UP)
    assert "The user wants a greeting." not in qwen_tok.decode(rerendered)
    assert "The user wants a greeting." in qwen_tok.decode(spliced)


def test_newline_after_im_end_that_the_model_never_samples(qwen3, qwen_tok):
    im_end = qwen_tok.convert_tokens_to_ids("<|im_end|>")
    output = enc(qwen_tok, "Hi.") + [im_end]
    prompt = qwen3.render(HIST, TOOLS)
    asst = assistant_from(qwen3, prompt, output)
    res = qwen3.bridge(prompt, output, FOLLOW_UP, tools=TOOLS, history=HIST + [asst])
    assert res.ok
    assert res.ids[0] == enc(qwen_tok, "\n")[0]  # the template's "\n" comes in the bridge
    rerendered = qwen3.render(HIST + [asst] + FOLLOW_UP, TOOLS)
    naive = prompt + output + qwen3.render(FOLLOW_UP, None)[:0] + enc(qwen_tok, "<|im_start|>user\nAgain.<|im_end|>\n<|im_start|>assistant\n")
    assert naive != prompt + output + res.ids  # gluing the new messages on misses the "\n"
    i = len(prompt) + len(output)
    assert rerendered[i - 1 : i + 1] == [im_end, enc(qwen_tok, "\n")[0]]


def test_model_writing_im_end_as_text(qwen3, qwen_tok):
    pieces = ["<", "|", "im", "_end", "|", ">"]
    literal = [t for p in pieces for t in enc(qwen_tok, p)]
    im_end = qwen_tok.convert_tokens_to_ids("<|im_end|>")
    assert im_end not in literal
    output = enc(qwen_tok, "Type ") + literal + enc(qwen_tok, " to end.") + [im_end]
    prompt, spliced, rerendered = check_drift(qwen3, HIST, output, FOLLOW_UP)
    # A plain re-tokenization of the text would turn the characters into the real end-of-turn token.
    assert enc(qwen_tok, "Type <|im_end|> to end.").count(im_end) == 1
    # Splice's re-render keeps them text (no forged turn end), but still not the sampled split.
    assert rerendered[len(prompt) :].count(im_end) == spliced[len(prompt) :].count(im_end)
    assert spliced != rerendered
    assert spliced[len(prompt) : len(prompt) + len(output)] == output


def test_user_typing_im_end_is_rendered_once_the_same_way(qwen3, qwen_tok):
    """A user's literal special-token text is rendered identically by the bridge and a full render."""
    output = enc(qwen_tok, "Sure.") + [qwen_tok.convert_tokens_to_ids("<|im_end|>")]
    new = [Message("user", "please print <|im_end|> now")]
    prompt, spliced, rerendered = check_drift(qwen3, HIST, output, new)
    assert spliced[len(prompt) + len(output) :] == rerendered[len(rerendered) - (len(spliced) - len(prompt) - len(output)) :]
