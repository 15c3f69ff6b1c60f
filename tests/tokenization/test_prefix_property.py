"""Property: every turn's prompt starts with the previous prompt + output, whatever was sampled."""

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenization import Message, Tool

from .helpers import assistant_from

TOOLS = [Tool("search", "search", {"type": "object", "properties": {"q": {"type": "string"}}})]

texts = st.text(st.characters(blacklist_categories=("Cs",)), min_size=0, max_size=40)
regular_ids = st.lists(st.integers(min_value=0, max_value=151642), min_size=0, max_size=30)


@st.composite
def sampled_turn(draw):
    """(kind, payload): random ids, or a tool call with unicode arguments, closed or cut off."""
    kind = draw(st.sampled_from(["ids", "tool_call", "text"]))
    closed = draw(st.booleans())
    if kind == "ids":
        return kind, draw(regular_ids), closed
    if kind == "tool_call":
        args = draw(st.dictionaries(st.sampled_from(["q", "k", "n"]), st.one_of(texts, st.booleans(), st.integers()), max_size=3))
        compact = draw(st.booleans())
        body = json.dumps({"name": "search", "arguments": args}, separators=(",", ":") if compact else None, ensure_ascii=draw(st.booleans()))
        return kind, f"<tool_call>\n{body}\n</tool_call>", closed
    return kind, draw(texts), closed


conversations = st.lists(st.tuples(sampled_turn(), texts, st.booleans()), min_size=1, max_size=5)


def run(cf, tok, close_id, turns):
    history = [Message("system", "s"), Message("user", "go")]
    prompt = cf.render(history, TOOLS)
    stops = set(cf.stop_token_ids)
    for (kind, payload, closed), follow_text, as_user in turns:
        output = list(payload) if kind == "ids" else tok.encode(payload, add_special_tokens=False)
        stop = next((i for i, t in enumerate(output) if t in stops), None)
        if stop is not None:  # the engine stops at a stop token: nothing is sampled after it
            output = output[: stop + 1]
        elif closed:
            output.append(close_id)
        asst = assistant_from(cf, prompt, output)
        history = history + [asst]
        if asst.tool_calls and not as_user:
            new = [Message("tool", follow_text, tool_call_id=tc.id) for tc in asst.tool_calls]
        else:
            new = [Message("user", follow_text)]
        res = cf.bridge(prompt, output, new, tools=TOOLS, history=history)
        assert res.ok, res.reason
        nxt = prompt + output + res.ids
        assert nxt[: len(prompt) + len(output)] == prompt + output
        history = history + new
        # The bridged part is what the template renders for the new messages (+ the close).
        full = cf.render(history, TOOLS)
        assert full[-len(res.ids) :] == res.ids
        prompt = nxt


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=conversations)
def test_qwen3_renderer_prefix_stable(qwen3, qwen_tok, turns):
    run(qwen3, qwen_tok, qwen_tok.convert_tokens_to_ids("<|im_end|>"), turns)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=conversations)
def test_generic_bridge_prefix_stable(generic, llama_style_tok, turns):
    run(generic, llama_style_tok, llama_style_tok.convert_tokens_to_ids("<|endoftext|>"), turns)
