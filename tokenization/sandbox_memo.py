"""Remembered answers to the chat-template sandbox's attribute checks.

``transformers`` renders chat templates in jinja's ``ImmutableSandboxedEnvironment``: before
each attribute the template reads off a value (``content.split``, ``message.items``,
``loop.last``, ``ns.last_query_index``) it asks ``is_safe_attribute(obj, attr, value)``, a
chain of ``isinstance`` checks. A full render of a short agent conversation asks it about a
hundred times (mostly about jinja's loop and namespace objects) and spent a third of its time
there. For the types a template sees (JSON's ``str``, ``dict``, ``list``, ..., jinja's
``LoopContext`` and ``Namespace``) jinja's answer depends only on the object's exact type and
the attribute's name: the checks are ``isinstance`` tests against fixed types and name tests,
never the value, and none of these types pretends to another class. So for them the answer is
kept per (type, name); any other type is asked every time, as before. What the sandbox refuses
it still refuses, on the first and every later ask.
"""

from __future__ import annotations

from typing import Any, Callable

# Exact types whose answer is the type's and the name's alone (the key is ``type(obj)`` itself,
# so no other class can pose as one), besides ``jinja2.utils.Namespace`` and its subclasses
# (``transformers`` defines one per compiled template).
PLAIN = frozenset({str, dict, list, tuple, int, float, bool, type(None)})
MAX_KEPT = 4096  # a template reading attributes by computed names cannot grow the memo past this


def memoize_sandbox_checks(tokenizer) -> int:
    """Install the memo on the environments ``apply_chat_template`` renders ``tokenizer``'s
    templates in (``transformers`` compiles each template once and reuses it). Returns how
    many environments got it; 0 where this ``transformers`` compiles differently (renders are
    then unchanged, only slower)."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        return 0
    source = getattr(tokenizer, "chat_template", None)
    sources = list(source.values()) if isinstance(source, dict) else [source]
    done = 0
    for text in sources:
        if not isinstance(text, str) or not text:
            continue
        try:
            env = _compile_jinja_template(text).environment
        except Exception:  # noqa: BLE001 - a template that does not compile fails in the render itself
            continue
        if "is_safe_attribute" not in vars(env):
            env.is_safe_attribute = remembered(env.is_safe_attribute)
        done += 1
    return done


def _kept_types() -> tuple[frozenset, type | None]:
    try:
        from jinja2.runtime import AsyncLoopContext, LoopContext
        from jinja2.utils import Namespace
    except ImportError:  # pragma: no cover - jinja2 is transformers' dependency for templates
        return PLAIN, None
    return PLAIN | {LoopContext, AsyncLoopContext}, Namespace


def remembered(check: Callable[[Any, str, Any], bool]) -> Callable[[Any, str, Any], bool]:
    """``check`` with its answers for the types above kept per (type, attribute name)."""
    kept: dict[tuple[type, str], bool] = {}
    plain, namespace = _kept_types()

    def is_safe_attribute(obj: Any, attr: str, value: Any) -> bool:
        kind = type(obj)
        if kind not in plain and not (namespace is not None and issubclass(kind, namespace)):
            return check(obj, attr, value)
        key = (kind, attr)
        answer = kept.get(key)
        if answer is None:
            answer = check(obj, attr, value)
            if len(kept) < MAX_KEPT:
                kept[key] = answer
        return answer

    return is_safe_attribute
