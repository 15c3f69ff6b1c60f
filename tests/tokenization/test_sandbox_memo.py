"""The remembered sandbox checks (tokenization/sandbox_memo.py) answer as jinja's own
``ImmutableSandboxedEnvironment`` does, on the first and on every later ask; renders are the
same text as jinja's unmodified path; and a template that reaches for what the sandbox forbids
is still refused, every time."""

from __future__ import annotations

import collections
import types

import jinja2
import pytest
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from transformers.utils.chat_template_utils import _compile_jinja_template

from tokenization import ChatFormat, Message, Tool, ToolCall, load_tokenizer, qwen3_tokenizer_dir
from tokenization.conversation import to_renderer_messages, to_template_tools
from tokenization.sandbox_memo import memoize_sandbox_checks, remembered

TOK = load_tokenizer(str(qwen3_tokenizer_dir()))


def _namespace():
    env = _compile_jinja_template("{{ 1 }}").environment
    return env.globals["namespace"](a=1)


def _cases():
    loop = LoopContext(iter([1, 2]), jinja2.runtime.Undefined)
    ns = _namespace()
    objs = ["text", {"a": 1}, [1], (1,), 3, 2.5, True, None, loop, ns, jinja2.utils.Namespace(a=1),
            collections.deque([1]), str, len, types.SimpleNamespace(x=1), (lambda: 0)]  # fmt: skip
    attrs = ["split", "startswith", "items", "get", "keys", "clear", "pop", "update", "append", "extend",
             "index0", "last", "first", "a", "x", "mro", "__class__", "__init__", "_private", "__globals__",
             "__code__", "format", "format_map", "real", "appendleft", "setdefault"]  # fmt: skip
    return [(o, a) for o in objs for a in attrs if hasattr(o, a)]


def test_every_answer_equals_jinjas_own_first_and_later():
    reference = ImmutableSandboxedEnvironment()
    check = remembered(ImmutableSandboxedEnvironment().is_safe_attribute)
    cases = _cases()
    assert any(not reference.is_safe_attribute(o, a, getattr(o, a)) for o, a in cases)  # refusals are in the mix
    for _ in range(3):  # the first ask fills the memo; later ones answer from it
        for obj, attr in cases + cases[::-1]:
            value = getattr(obj, attr)
            assert check(obj, attr, value) == reference.is_safe_attribute(obj, attr, value), (type(obj), attr)


def _conversations():
    tools = [Tool(name="f", description="Step.", parameters={"type": "object", "properties": {"x": {"type": "integer"}}})]
    msgs = [Message(role="system", content="Be brief."), Message(role="user", content="Go.")]
    out = [(list(msgs), None), (list(msgs), tools)]
    for k in range(3):
        msgs.append(Message(role="assistant", content="ok", reasoning="think" if k == 1 else None,
                            tool_calls=(ToolCall(id=f"c{k}", name="f", arguments='{"x": %d}' % k),)))  # fmt: skip
        msgs.append(Message(role="tool", content=f"r{k}", tool_call_id=f"c{k}"))
        out.append((list(msgs), tools))
    msgs.append(Message(role="user", content="And now?"))
    out.append((list(msgs), tools))
    return out


def test_renders_equal_the_unmodified_sandboxs_text():
    fmt = ChatFormat(TOK, "qwen3")  # installs the memo on the template's environment
    env = _compile_jinja_template(TOK.chat_template).environment
    memo = vars(env)["is_safe_attribute"]
    try:
        for messages, tools in _conversations():
            rm, tl = to_renderer_messages(messages), to_template_tools(tools)
            del env.is_safe_attribute  # jinja's own check, every time
            plain = fmt.template.render_text(rm, tl, add_generation_prompt=True)
            env.is_safe_attribute = memo
            for _ in range(2):
                assert fmt.template.render_text(rm, tl, add_generation_prompt=True) == plain
    finally:
        env.is_safe_attribute = memo


@pytest.mark.parametrize("hostile", [
    "{{ messages.append(1) }}",
    "{% for m in messages %}{{ m.clear() }}{% endfor %}",
    "{{ ''.__class__.__mro__ }}",
    "{% set ns = namespace(a=1) %}{{ ns.__init__.__globals__ }}",
    "{% for m in messages %}{{ loop.__init__.__globals__ }}{% endfor %}",
])  # fmt: skip
def test_what_the_sandbox_forbids_stays_forbidden(hostile):
    """The same refusal as jinja's unmodified sandbox gives, on every render."""

    def render() -> str:
        try:
            return TOK.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=hostile, tokenize=False)
        except jinja2.exceptions.TemplateError as exc:
            return f"refused: {type(exc).__name__}: {exc}"

    reference = render()  # before the memo: jinja's own checks
    assert reference.startswith("refused: ")
    assert memoize_sandbox_checks(types.SimpleNamespace(chat_template=hostile)) == 1
    assert "is_safe_attribute" in vars(_compile_jinja_template(hostile).environment)
    for _ in range(3):
        assert render() == reference
