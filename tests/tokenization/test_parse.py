from tokenization import ChatFormat


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_reasoning_text_and_tool_calls(qwen3, qwen_tok):
    ids = enc(qwen_tok, '<think>\nplan\n</think>\n\nLet me look.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call><|im_end|>')
    p = qwen3.parse(ids)
    assert p.reasoning == "plan"
    assert p.content.strip() == "Let me look."
    assert [(c.name, c.arguments) for c in p.tool_calls] == [("a", '{"x": 1}'), ("b", "{}")]
    assert not p.malformed and not p.truncated


def test_malformed_call_is_flagged_kept_as_text_and_good_calls_survive(qwen3, qwen_tok):
    bad = '{"name": "b", "arguments": {"x": 1'
    ids = enc(qwen_tok, f'<tool_call>\n{{"name": "a", "arguments": {{}}}}\n</tool_call>\n<tool_call>\n{bad}\n</tool_call>\n<tool_call>\n{{"name": "c", "arguments": {{"y": 2}}}}\n</tool_call><|im_end|>')
    p = qwen3.parse(ids)
    assert [c.name for c in p.tool_calls] == ["a", "c"]
    assert p.malformed and p.malformed_calls[0].status == "invalid_json"
    assert bad in p.content  # returned as text, not repaired
    assert '"y": 2' in p.tool_calls[1].arguments


def test_output_cut_by_length_limit(qwen3, qwen_tok):
    ids = enc(qwen_tok, '<think>\nplan\n</think>\n\n<tool_call>\n{"name": "a", "argu')
    p = qwen3.parse(ids, finish_reason="length")
    assert p.truncated
    assert p.tool_calls == ()
    assert p.malformed_calls and p.malformed_calls[0].status == "unclosed_block"
    assert '"argu' in p.content


def test_generic_format_parses_hermes_calls(generic, llama_style_tok):
    ids = enc(llama_style_tok, '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call><|endoftext|>')
    p = generic.parse(ids)
    assert [(c.name, c.arguments) for c in p.tool_calls] == [("a", '{"x": 1}')]


def test_thinking_retention_maps_onto_the_renderer(qwen_tok):
    from tokenization import Message

    hist = [Message("user", "hi")]
    out = enc(qwen_tok, "<think>\nx\n</think>\n\nhey<|im_end|>")
    asst = Message("assistant", "hey", reasoning="x")
    for retention, ok in (("all", True), ("tool_cycle", False), ("template", False)):
        cf = ChatFormat(qwen_tok, "qwen3", thinking_retention=retention)
        prompt = cf.render(hist)
        res = cf.bridge(prompt, out, [Message("user", "again")], history=hist + [asst])
        assert res.ok is ok, retention
        if not ok:
            assert res.reason == "thinking_stripped"
    # tool_cycle still bridges a tool result inside the cycle
    cf = ChatFormat(qwen_tok, "qwen3", thinking_retention="tool_cycle")
    res = cf.bridge(cf.render(hist), out, [Message("tool", "r", tool_call_id="c")], history=hist + [asst])
    assert res.ok


def test_matched_stop_string_is_cut_from_the_text_not_from_the_ids(qwen3, qwen_tok):
    ids = enc(qwen_tok, "one two three END and more")
    p = qwen3.parse(ids, stop_text="END")
    assert p.content == "one two three "
    assert qwen3.parse(ids).content == "one two three END and more"


def test_stop_text_filter_holds_back_and_drops_the_stop_string():
    from tokenization.incremental import StopTextFilter

    for pieces in (["one two thr", "ee EN", "D and more"], ["one two three E", "ND"], ["one two three ", "END"]):
        f = StopTextFilter(["END"])
        out = "".join(f.push(p) for p in pieces) + f.flush()
        assert out == "one two three "
    f = StopTextFilter(["END"])
    assert "".join(f.push(p) for p in ["no E", "nd here E"]) + f.flush() == "no End here E"
    assert StopTextFilter([]).push("x") == "x"


def test_calls_of_undeclared_tools_are_text_and_flagged(qwen3, qwen_tok):
    from tokenization import Tool

    ids = enc(qwen_tok, '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "rm", "arguments": {"p": "/"}}\n</tool_call><|im_end|>')
    p = qwen3.parse(ids, tools=[Tool("a")])
    assert [c.name for c in p.tool_calls] == ["a"]
    assert [m.status for m in p.malformed_calls] == ["undeclared_tool"]
    assert '{"name": "rm", "arguments": {"p": "/"}}' in p.content
    none_sent = qwen3.parse(ids, tools=[])  # no tools declared: every call is text
    assert none_sent.tool_calls == () and len(none_sent.malformed_calls) == 2
    assert [c.name for c in qwen3.parse(ids).tool_calls] == ["a", "rm"]  # tools=None: names not checked
