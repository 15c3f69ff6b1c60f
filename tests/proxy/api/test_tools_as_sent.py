"""Tools reach the chat template with every field the client sent (``strict: false`` included),
in all three dialects: the prompt Splice renders for a request equals the model's own
``apply_chat_template`` of the same request (real Qwen3 tokenizer), as SGLang's and vLLM's chat
endpoints render it."""

from __future__ import annotations

import httpx

SCHEMA = {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"], "additionalProperties": False}
MSGS = [{"role": "system", "content": "You run commands."}, {"role": "user", "content": "List the files."}]


def _reference(tok, messages, nested_tools) -> list[int]:
    return list(tok.apply_chat_template(messages, tools=nested_tools, add_generation_prompt=True, tokenize=True, return_dict=False))


def _rendered(live) -> list[int]:
    req = live.runner.requests[-1]
    return live.runner.fmt.render(req.messages, req.tools, template_kwargs=req.chat_template_kwargs)


def test_chat_tools_as_sent(live, tok):
    tools = [
        {"type": "function", "function": {"name": "shell", "description": "Run a command.", "parameters": SCHEMA, "strict": False}},
        {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}},  # no description
    ]
    r = httpx.post(live.base_url + "/v1/chat/completions", json={"model": "m", "messages": MSGS, "tools": tools}, timeout=30)
    assert r.status_code == 200, r.text
    want = _reference(tok, MSGS, tools)
    got = _rendered(live)
    assert got == want
    assert '"strict": false' in tok.decode(got)
    # without the field the prompt is shorter: the field really reaches the model
    plain = [{"type": "function", "function": {k: v for k, v in tools[0]["function"].items() if k != "strict"}}, tools[1]]
    assert len(_reference(tok, MSGS, plain)) < len(want)


def test_responses_tools_as_sent(live, tok):
    tools = [
        {"type": "function", "name": "shell", "description": "Run a command.", "strict": False, "parameters": SCHEMA},
        {"type": "function", "name": "read", "description": "Read a file.", "parameters": SCHEMA, "strict": True},
    ]
    body = {"model": "m", "instructions": MSGS[0]["content"], "input": MSGS[1]["content"], "tools": tools}
    r = httpx.post(live.base_url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 200, r.text
    nested = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in tools]
    got = _rendered(live)
    assert got == _reference(tok, MSGS, nested)
    text = tok.decode(got)
    assert '"strict": false, "parameters"' in text and '"strict": true}' in text  # each field where it was sent


def test_messages_tools_as_sent(live, tok):
    tools = [
        {"name": "Bash", "description": "Run a command.", "input_schema": SCHEMA, "strict": False, "cache_control": {"type": "ephemeral"}},
        {"name": "Read", "input_schema": SCHEMA},
    ]
    body = {"model": "m", "max_tokens": 64, "system": MSGS[0]["content"], "messages": [MSGS[1]], "tools": tools}
    r = httpx.post(live.base_url + "/v1/messages", json=body, timeout=30)
    assert r.status_code == 200, r.text
    # the same request in OpenAI's shape: input_schema is parameters; cache_control is a
    # request annotation (prompt caching), not part of the definition
    nested = [
        {"type": "function", "function": {"name": "Bash", "description": "Run a command.", "parameters": SCHEMA, "strict": False}},
        {"type": "function", "function": {"name": "Read", "parameters": SCHEMA}},
    ]
    got = _rendered(live)
    assert got == _reference(tok, MSGS, nested)
    assert "cache_control" not in tok.decode(got)


def test_a_changed_strict_field_changes_the_tools_fingerprint():
    from tokenization.conversation import Tool, tools_fingerprint

    plain = Tool("shell", "Run.", SCHEMA)
    assert tools_fingerprint([plain]) == tools_fingerprint([Tool("shell", "Run.", SCHEMA, spec={"name": "shell", "description": "Run.", "parameters": SCHEMA})])
    strict = Tool("shell", "Run.", SCHEMA, spec={"name": "shell", "description": "Run.", "parameters": SCHEMA, "strict": False})
    assert tools_fingerprint([strict]) != tools_fingerprint([plain])
