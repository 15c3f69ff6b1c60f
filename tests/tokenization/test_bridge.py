"""The bridge: refusals with reasons, the generic bridge against the full render, no re-renders."""

from tokenization import Message, Tool

from .helpers import assistant_from, spliced_prompt

TOOLS = [Tool("add", "add numbers", {"type": "object", "properties": {"a": {"type": "integer"}}})]


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_refusals_carry_reasons(qwen3, qwen_tok):
    hist = [Message("user", "hi")]
    prompt = qwen3.render(hist)
    out = enc(qwen_tok, "hey<|im_end|>")
    asst = Message("assistant", "hey")
    assert qwen3.bridge(prompt, out, [], history=hist + [asst]).reason == "no_new_messages"
    injected = [Message("assistant", "I said something else"), Message("user", "?")]
    assert qwen3.bridge(prompt, out, injected, history=hist + [asst]).reason == "history_edited"


def test_length_cut_turn_gets_its_close(qwen3, qwen_tok):
    hist = [Message("user", "count")]
    prompt = qwen3.render(hist)
    out = enc(qwen_tok, "one two thr")  # no <|im_end|>: stopped by max tokens
    res = qwen3.bridge(prompt, out, [Message("user", "go on")], history=hist + [Message("assistant", "one two thr")])
    assert res.ok
    assert res.ids[0] == qwen_tok.convert_tokens_to_ids("<|im_end|>")


def test_generic_bridge_equals_full_render_on_canonical_output(generic, llama_style_tok):
    """A Llama-3-style template with no hand-coded renderer: splice == full render, turn after turn."""
    tok = llama_style_tok
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    history = [Message("system", "Be brief."), Message("user", "Add 2 and 3.")]
    prompt = generic.render(history, TOOLS)
    assert prompt == tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 2 and 3."}],
        tools=[{"type": "function", "function": {"name": "add", "description": "add numbers", "parameters": TOOLS[0].parameters}}],
        add_generation_prompt=True, tokenize=True, return_dict=False,
    )
    replies = ["Calling.", "Five.", "Done here."]
    follow_ups = [[Message("tool", "5", tool_call_id="c0")], [Message("user", "Thanks!")], [Message("user", "Bye.")]]
    for reply, new in zip(replies, follow_ups):
        output = enc(tok, reply) + [eot]
        asst = assistant_from(generic, prompt, output)
        assert asst.content == reply
        history = history + [asst]
        nxt = spliced_prompt(generic, prompt, output, history, new, TOOLS)
        history = history + new
        assert nxt == generic.render(history, TOOLS)
        prompt = nxt


def test_generic_bridge_refuses_when_it_cannot_prove(generic, llama_style_tok):
    tok = llama_style_tok
    hist = [Message("user", "hi")]
    prompt = generic.render(hist)
    out = enc(tok, "hey") + [tok.convert_tokens_to_ids("<|im_end|>")]  # a terminator that is not this template's close
    res = generic.bridge(prompt, out, [Message("user", "x")], history=hist + [Message("assistant", "hey")])
    assert not res.ok and res.reason == "unknown_turn_close"
    res = generic.bridge(prompt, out, [Message("user", "x")], history=hist)
    assert res.reason == "no_assistant_turn"


class CountingTokenizer:
    """Wraps a tokenizer and counts how much text the bridge encodes or renders."""

    def __init__(self, tok):
        self._tok = tok
        self.encoded_chars = 0
        self.rendered_messages = 0

    def __getattr__(self, name):
        if name == "backend_tokenizer":  # route every encode through the counter
            raise AttributeError(name)
        return getattr(self._tok, name)

    def encode(self, text, *a, **k):
        self.encoded_chars += len(text)
        return self._tok.encode(text, *a, **k)

    def __call__(self, text, *a, **k):
        self.encoded_chars += len(text)
        return self._tok(text, *a, **k)

    def apply_chat_template(self, messages, *a, **k):
        self.rendered_messages += len(messages)
        return self._tok.apply_chat_template(messages, *a, **k)


def _bridge_cost(make_format, base_tok, turns, result="result {k}", eot=None):
    tok = CountingTokenizer(base_tok)
    cf = make_format(tok)
    eot = cf.stop_token_ids[0] if eot is None else eot
    history = [Message("system", "sys"), Message("user", "start")]
    prompt = cf.render(history, TOOLS)
    costs = []
    for k in range(turns):
        output = base_tok.encode(f"step {k}", add_special_tokens=False) + [eot]
        asst = Message("assistant", f"step {k}")
        history = history + [asst]
        new = [Message("tool", result.format(k=k), tool_call_id=f"c{k}")]
        before = (tok.encoded_chars, tok.rendered_messages, cf.render_calls)
        res = cf.bridge(prompt, output, new, tools=TOOLS, history=history)
        assert res.ok, res.reason
        costs.append((tok.encoded_chars - before[0], tok.rendered_messages - before[1], cf.render_calls - before[2]))
        history = history + new
        prompt = prompt + output + res.ids
    return costs


def test_bridge_never_rerenders_the_history(qwen_tok, llama_style_tok):
    from tokenization import ChatFormat

    for make, base in ((lambda t: ChatFormat(t, "qwen3"), qwen_tok), (lambda t: ChatFormat(t, None), llama_style_tok)):
        costs = _bridge_cost(make, base, 40)
        assert all(c[2] == 0 for c in costs)  # no full render
        assert costs[1][0] > 0  # the counter does see the bridge's encoding
        # work at turn 40 is the same as at turn 2: it does not grow with the conversation
        assert costs[-1][0] <= costs[1][0] + 4 and costs[-1][1] == costs[1][1]


def test_bridge_with_control_token_text_does_not_rerender_the_history(qwen_tok):
    """Tool results that spell control tokens go through the template bridge: still bounded."""
    from tokenization import ChatFormat

    im_end = qwen_tok.convert_tokens_to_ids("<|im_end|>")
    costs = _bridge_cost(lambda t: ChatFormat(t, "qwen3"), qwen_tok, 30, result="result {k} <|im_end|>", eot=im_end)
    assert all(c[2] == 0 for c in costs)
    assert costs[1][1] > 0  # the template bridge renders a (small) context
    assert costs[-1][0] <= costs[1][0] + 4 and costs[-1][1] == costs[1][1]
