"""Content the dialects share: text and images from content parts, the tools offered to the model (function,
namespace and freeform tools; hosted tools reported, not offered), ``tool_choice`` checks and the
controls Splice records but does not enforce, tool messages named after the call they answer."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import orjson

from tokenization.conversation import Message, Part, Tool

from ..errors import bad_request
from .images import IMAGE_PART_TYPES, ImageRequest

log = logging.getLogger("splice.tools")

TEXT_PARTS = {"input_text", "output_text", "text", "summary_text", "reasoning_text"}
# Parts Splice cannot render; images only where a message takes them and the model has an
# image processor (``parts_of``).
UNSUPPORTED_PARTS = {"input_image", "input_file", "input_audio", "image_url", "image", "file", "audio"}


def text_of(content: Any, where: str, *, allow_refusal: bool = True) -> str:
    """Text of a string or a list of content parts; images and files are rejected."""
    return "\n".join(p for p in parts_of(content, where, allow_refusal=allow_refusal) if isinstance(p, str))


def parts_of(content: Any, where: str, *, images: ImageRequest | None = None, allow_refusal: bool = True) -> list[Part]:
    """Ordered text and image parts of a string or a list of content parts.

    ``images``: the request's images, for a message that may carry them (user and tool
    messages); None: image parts are rejected (400) as in any other message. Files and audio
    are always rejected.
    """
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts", code="invalid_value", param=where)
    texts: list[Part] = []
    for j, part in enumerate(content):
        pw = f"{where}[{j}]"
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise bad_request(f"{pw} must be a content part object", code="invalid_value", param=pw)
        typ = part.get("type")
        if typ in TEXT_PARTS:
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_request(f"{pw} ({typ}) needs a string 'text'", code="invalid_value", param=pw)
            texts.append(text)
        elif typ == "refusal" and allow_refusal:
            texts.append(str(part.get("refusal") or ""))
        elif typ in IMAGE_PART_TYPES and images is not None:
            texts.append(images.image(part, pw))
        elif typ in IMAGE_PART_TYPES:
            raise bad_request(
                f"{pw} has type '{typ}': images are accepted in user and tool messages only",
                code="unsupported_content",
                param=pw,
            )
        elif typ in UNSUPPORTED_PARTS:
            raise bad_request(
                f"{pw} has type '{typ}': Splice serves text-only models; images, files and audio are not supported",
                code="unsupported_content",
                param=pw,
            )
        else:
            raise bad_request(f"{pw} has unsupported content part type {typ!r}", code="unsupported_content", param=pw)
    return texts


def message_of(role: str, content: Any, where: str, *, images: ImageRequest | None = None, allow_refusal: bool = True, **kw: Any) -> Message:
    """A ``Message`` of ``role`` from string or list content (with image parts if ``images``)."""
    return Message.from_parts(role, parts_of(content, where, images=images, allow_refusal=allow_refusal), **kw)


def name_tool_messages(messages: list[Message], names: dict[str, str] | None = None) -> list[Message]:
    """Give tool messages the function name of the call they answer (some templates show it).
    ``names``: tool-call id -> name of the calls before ``messages`` (extended in place)."""
    names = {} if names is None else names
    out: list[Message] = []
    for m in messages:
        for tc in m.tool_calls:
            names[tc.id] = tc.name
        if m.role == "tool" and m.name is None and m.tool_call_id in names:
            m = Message(role="tool", content=m.content, tool_call_id=m.tool_call_id, name=names[m.tool_call_id], parts=m.parts)
        out.append(m)
    return out


# Tools the proxy cannot run: a hosted tool runs on OpenAI's / Anthropic's servers, so the model
# Splice serves is not told about it (its call could never be answered). Anthropic's versioned
# server tools (``web_search_20250305``, ``code_execution_20250522``, ...) are matched by prefix.
HOSTED_TOOLS = (
    "web_search", "web_search_preview", "file_search", "code_interpreter", "image_generation",
    "computer_use", "computer_use_preview", "computer", "mcp", "local_shell", "tool_search",
    "web_fetch", "code_execution", "bash", "text_editor", "memory",
)  # fmt: skip

_logged_hosted: set[str] = set()


def _hosted_type(typ: str) -> str | None:
    """The hosted tool family of ``typ`` (``web_search_20250305`` -> ``web_search``), else None."""
    for h in HOSTED_TOOLS:
        if typ == h or (typ.startswith(h + "_") and typ[len(h) + 1 :].isdigit()):
            return typ
    return None


@dataclass
class ToolSet:
    """The tools one request offers the model, and what it sent that is not offered.

    ``namespaces`` maps a flattened tool's name back to ``(namespace, name)`` (Codex's
    ``namespace`` tools: a call is answered with its ``namespace`` field set); ``custom`` names
    the freeform tools (one string input, answered as ``custom_tool_call`` items).
    """

    tools: list[Tool] = field(default_factory=list)
    echo: list[dict[str, Any]] = field(default_factory=list)
    not_offered: list[str] = field(default_factory=list)
    namespaces: dict[str, tuple[str, str]] = field(default_factory=dict)
    custom: frozenset[str] = frozenset()

    def visible_name(self, namespace: str | None, name: str) -> str:
        """The name the model knows a (namespaced) tool by."""
        if namespace:
            for visible, (ns, n) in self.namespaces.items():
                if ns == namespace and n == name:
                    return visible
        return name


CUSTOM_INPUT = "input"  # the one string argument a freeform tool is offered with


def _custom_parameters(spec: dict[str, Any]) -> dict[str, Any]:
    fmt = spec.get("format") if isinstance(spec.get("format"), dict) else {}
    desc = "The raw input for this tool"
    if fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
        desc += f" (it must match this {fmt.get('syntax') or 'grammar'} grammar):\n{fmt['definition']}"
    return {"type": "object", "properties": {CUSTOM_INPUT: {"type": "string", "description": desc}}, "required": [CUSTOM_INPUT]}


def offer_tools(tools: list[dict[str, Any]] | None, *, hosted_ok: bool = True, freeform_ok: bool = True) -> ToolSet:
    """Every dialect's tools -> the function tools the model is offered.

    Function tools (Responses' flat shape, Chat's nested one, Anthropic's ``input_schema``),
    Codex's ``namespace`` tools (flattened into their function tools), freeform ``custom``
    tools (offered as a function with one string ``input``); hosted tools are not offered,
    logged once per type and listed in ``not_offered``.
    """
    ts = ToolSet()
    if not tools:
        return ts
    seen: set[str] = set()
    custom: set[str] = set()
    flat: list[tuple[str, dict[str, Any], str | None]] = []  # (where, spec, namespace)
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise bad_request(f"{where} must be an object", code="invalid_value", param=where)
        typ = t.get("type") or "function"
        if typ == "namespace":
            inner = t.get("tools")
            if not isinstance(inner, list) or not isinstance(t.get("name"), str):
                raise bad_request(f"{where} (namespace) needs a 'name' and a list of 'tools'", code="invalid_value", param=where)
            for j, it in enumerate(inner):
                if not isinstance(it, dict):
                    raise bad_request(f"{where}.tools[{j}] must be an object", code="invalid_value", param=f"{where}.tools[{j}]")
                flat.append((f"{where}.tools[{j}]", it, t["name"]))
        else:
            flat.append((where, t, None))
    inner_names = [str(s.get("name")) for _, s, ns in flat if ns is None]
    for where, t, namespace in flat:
        typ = t.get("type") or ("function" if "input_schema" in t or "function" in t or "name" in t else None)
        if typ == "custom" and "input_schema" in t:
            typ = "function"  # Anthropic's client tools may say type "custom"
        if typ == "custom" and not freeform_ok:
            raise bad_request(f"{where} has type 'custom': freeform tools are served on the Responses API", code="unsupported_tool", param=where)
        if typ not in ("function", "custom"):
            hosted = _hosted_type(str(typ)) if isinstance(typ, str) else None
            if hosted is None or not hosted_ok:
                raise bad_request(
                    f"{where} has type {typ!r}: Splice runs the model itself; it offers function, custom and "
                    "namespace tools (hosted tools such as web_search are accepted and not offered)",
                    code="unsupported_tool", param=where,
                )  # fmt: skip
            ts.not_offered.append(hosted)
            if hosted not in _logged_hosted and len(_logged_hosted) < 256:
                _logged_hosted.add(hosted)
                log.warning("hosted tool %r is not offered to the model (Splice cannot run it); reported in the splice block", hosted)
            continue
        spec = t.get("function") if isinstance(t.get("function"), dict) else t  # tolerate the Chat shape
        if typ == "custom" and isinstance(t.get("custom"), dict):
            spec = t["custom"]  # Chat's nested custom shape
        name = spec.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"{where} needs a 'name'", code="missing_required_parameter", param=f"{where}.name")
        visible = name
        if namespace is not None and name in inner_names:
            visible = f"{namespace}__{name}"  # the model needs one name per tool
        if visible in seen:
            raise bad_request(f"{where}: duplicate function name {name!r}", code="invalid_value", param=f"{where}.name")
        seen.add(visible)
        desc = spec.get("description")
        if desc is not None and not isinstance(desc, str):
            raise bad_request(f"{where}.description must be a string", code="invalid_value", param=f"{where}.description")
        if typ == "custom":
            params = _custom_parameters(spec)
            custom.add(visible)
            ts.echo.append({k: v for k, v in spec.items() if k != "type"} | {"type": "custom"})
        else:
            params = spec.get("parameters") if "parameters" in spec else spec.get("input_schema")
            if params is not None and not isinstance(params, dict):
                raise bad_request(f"{where}.parameters must be a JSON schema object", code="invalid_value", param=f"{where}.parameters")
            ts.echo.append(
                {
                    "type": "function",
                    "name": name,
                    "description": desc,
                    "parameters": params,
                    "strict": spec.get("strict", True) if spec.get("strict") is not None else True,
                }
            )
        if namespace is not None:
            ts.namespaces[visible] = (namespace, name)
        sent = None if typ == "custom" else _function_as_sent(spec, visible)
        ts.tools.append(Tool(name=visible, description=desc or "", parameters=params or {}, spec=sent))
    ts.custom = frozenset(custom)
    return ts


# Request annotations on a tool, not part of its definition: never shown to the model.
_NOT_DEFINITION = frozenset({"type", "cache_control"})


def _function_as_sent(spec: dict[str, Any], visible: str) -> dict[str, Any]:
    """The function object the chat template renders: every field the client sent, in its order
    (``strict: false`` included, as SGLang's and vLLM's chat endpoints pass it), Anthropic's
    ``input_schema`` under OpenAI's name ``parameters``, the name as the model is offered it."""
    out: dict[str, Any] = {}
    for k, v in spec.items():
        if k in _NOT_DEFINITION:
            continue
        if k == "input_schema":
            if "parameters" in spec:
                continue
            k = "parameters"
        out[k] = visible if k == "name" else v
    return out


def convert_tools(tools: list[dict[str, Any]] | None) -> tuple[list[Tool], list[dict[str, Any]]]:
    """Function tools -> ``Tool``; also the normalized echo for the Response object."""
    ts = offer_tools(tools, hosted_ok=False)
    return ts.tools, ts.echo


def custom_input(arguments: str) -> str:
    """A freeform tool's input from the arguments the model wrote (``{"input": "..."}``)."""
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return arguments
    if isinstance(value, dict) and isinstance(value.get(CUSTOM_INPUT), str) and len(value) == 1:
        return value[CUSTOM_INPUT]
    return arguments


def custom_arguments(text: str) -> str:
    """The arguments a replayed freeform call was sampled as (JSON values compare, not spacing)."""
    return orjson.dumps({CUSTOM_INPUT: text}).decode()


def unenforced(controls: dict[str, Any]) -> dict[str, Any]:
    """The controls a request set that Splice records but does not enforce (values kept)."""
    return {k: v for k, v in controls.items() if v is not None}


def tool_choice_control(tool_choice: Any) -> Any:
    """``tool_choice`` when it asks for more than ``auto`` (required, a named tool, none), else None.

    Forcing or forbidding calls needs constrained decoding (the trainer's distribution would
    differ), and ``none`` would change the rendered tools (a fork), so none of them is enforced.
    """
    if tool_choice is None or tool_choice == "auto":
        return None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "auto":
        return None
    return tool_choice


def check_tool_choice(tool_choice: Any, tools: list[Tool], param: str = "tool_choice") -> None:
    if tool_choice is None:
        return
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise bad_request(f"invalid value for '{param}': {tool_choice!r} (expected none, auto, required or a function)", code="invalid_value", param=param)
        return
    if isinstance(tool_choice, dict):
        typ = tool_choice.get("type")
        if typ in ("function", "custom"):
            name = tool_choice.get("name") or (tool_choice.get(typ) or {}).get("name")
            if not name or name not in {t.name for t in tools}:
                raise bad_request(f"'{param}' names function {name!r}, which is not in 'tools'", code="invalid_value", param=param)
            return
        if typ == "allowed_tools" or (isinstance(typ, str) and _hosted_type(typ)):
            return
        raise bad_request(f"'{param}' of type {typ!r} is not supported by Splice", code="invalid_value", param=param)
    raise bad_request(f"invalid value for '{param}'", code="invalid_value", param=param)
