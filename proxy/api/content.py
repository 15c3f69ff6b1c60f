"""Content the dialects share: text from content parts, function tools in Splice's ``Tool``
form, ``tool_choice`` checks, tool messages named after the call they answer."""

from __future__ import annotations

from typing import Any

from tokenization.conversation import Message, Tool

from ..errors import bad_request

TEXT_PARTS = {"input_text", "output_text", "text", "summary_text", "reasoning_text"}
UNSUPPORTED_PARTS = {"input_image", "input_file", "input_audio", "image_url", "image", "file", "audio"}


def text_of(content: Any, where: str, *, allow_refusal: bool = True) -> str:
    """Text of a string or a list of content parts; images and files are rejected."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts", code="invalid_value", param=where)
    texts: list[str] = []
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
        elif typ in UNSUPPORTED_PARTS:
            raise bad_request(
                f"{pw} has type '{typ}': Splice serves text-only models; images, files and audio are not supported",
                code="unsupported_content",
                param=pw,
            )
        else:
            raise bad_request(f"{pw} has unsupported content part type {typ!r}", code="unsupported_content", param=pw)
    return "\n".join(texts)


def name_tool_messages(messages: list[Message]) -> list[Message]:
    """Give tool messages the function name of the call they answer (some templates show it)."""
    names: dict[str, str] = {}
    out: list[Message] = []
    for m in messages:
        for tc in m.tool_calls:
            names[tc.id] = tc.name
        if m.role == "tool" and m.name is None and m.tool_call_id in names:
            m = Message(role="tool", content=m.content, tool_call_id=m.tool_call_id, name=names[m.tool_call_id])
        out.append(m)
    return out


def convert_tools(tools: list[dict[str, Any]] | None) -> tuple[list[Tool], list[dict[str, Any]]]:
    """Flat function tools -> ``Tool``; also the normalized echo for the Response object."""
    if not tools:
        return [], []
    out: list[Tool] = []
    echo: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise bad_request(f"{where} must be an object", code="invalid_value", param=where)
        typ = t.get("type", "function")
        if typ != "function":
            raise bad_request(
                f"{where} has type {typ!r}: Splice runs the model itself and supports only function tools "
                "(hosted tools such as web_search or file_search are not available)",
                code="unsupported_tool",
                param=where,
            )
        spec = t.get("function") if isinstance(t.get("function"), dict) else t  # tolerate the Chat shape
        name = spec.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"{where} needs a 'name'", code="missing_required_parameter", param=f"{where}.name")
        if name in seen:
            raise bad_request(f"{where}: duplicate function name {name!r}", code="invalid_value", param=f"{where}.name")
        seen.add(name)
        params = spec.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"{where}.parameters must be a JSON schema object", code="invalid_value", param=f"{where}.parameters")
        desc = spec.get("description")
        if desc is not None and not isinstance(desc, str):
            raise bad_request(f"{where}.description must be a string", code="invalid_value", param=f"{where}.description")
        out.append(Tool(name=name, description=desc or "", parameters=params or {}))
        echo.append(
            {
                "type": "function",
                "name": name,
                "description": desc,
                "parameters": params,
                "strict": spec.get("strict", True) if spec.get("strict") is not None else True,
            }
        )
    return out, echo


def check_tool_choice(tool_choice: Any, tools: list[Tool], param: str = "tool_choice") -> None:
    if tool_choice is None:
        return
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise bad_request(f"invalid value for '{param}': {tool_choice!r} (expected none, auto, required or a function)", code="invalid_value", param=param)
        return
    if isinstance(tool_choice, dict):
        typ = tool_choice.get("type")
        if typ == "function":
            name = tool_choice.get("name") or (tool_choice.get("function") or {}).get("name")
            if not name or name not in {t.name for t in tools}:
                raise bad_request(f"'{param}' names function {name!r}, which is not in 'tools'", code="invalid_value", param=param)
            return
        if typ == "allowed_tools":
            return
        raise bad_request(f"'{param}' of type {typ!r} is not supported by Splice", code="invalid_value", param=param)
    raise bad_request(f"invalid value for '{param}'", code="invalid_value", param=param)
