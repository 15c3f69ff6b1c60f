"""Tool-call arguments as JSON values (what history fingerprints compare): the standard
library's ``json.loads`` is the reference, whichever parser reads them."""

import json
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenization.conversation import Message, ToolCall, fingerprint

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(value=_json, spaced=st.booleans())
def test_arguments_value_equals_json_loads(value, spaced):
    text = json.dumps(value, indent=1 if spaced else None, ensure_ascii=spaced)
    got = ToolCall("c", "f", text).arguments_value()
    assert got == json.loads(text) and type(got) is type(json.loads(text))


def test_what_only_the_standard_library_reads_is_still_read():
    wide = ToolCall("c", "f", '{"n": 123456789012345678901234567890}').arguments_value()
    assert wide == {"n": 123456789012345678901234567890}
    assert math.isnan(ToolCall("c", "f", '{"x": NaN}').arguments_value()["x"])
    assert ToolCall("c", "f", '{"x": -Infinity}').arguments_value() == {"x": -math.inf}
    assert ToolCall("c", "f", '{"x": 1e400}').arguments_value() == {"x": math.inf}


def test_text_that_is_not_json_is_kept_as_text():
    assert ToolCall("c", "f", "{not json").arguments_value() == "{not json"
    assert ToolCall("c", "f", "").arguments_value() == ""


def test_spacing_and_key_order_do_not_change_a_history_fingerprint():
    def history(args: str):
        return [Message(role="user", content="go"), Message(role="assistant", content="", tool_calls=[ToolCall("c", "f", args)])]

    assert fingerprint(history('{"b": 1, "a": [1.5, "x"]}')) == fingerprint(history('{"a":[1.5,"x"],"b":1}'))
    assert fingerprint(history('{"a": 1}')) != fingerprint(history('{"a": 2}'))
