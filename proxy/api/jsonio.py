"""JSON in and out for every route: orjson both ways, pydantic errors as OpenAI-shaped 400s.

Every request body is checked before any work: valid JSON, an object, nested at most
``MAX_DEPTH`` levels (orjson reads 1,024 levels but writes only 255, and everything a client
sends may be echoed, stored or logged), and then validated by the route's model.
"""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from ..errors import APIError, bad_request


def dumps(obj: Any) -> bytes:
    return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY)


class JSONResponse(Response):
    """orjson-rendered JSON (fast; non-finite floats become null)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return content if isinstance(content, bytes) else dumps(content)


MAX_DEPTH = 64  # nesting levels of a request body (orjson writes at most 255)
SHORT_BODY = 4096  # bytes: below this, two bracket counts (a few µs) cost less than the walk


def check_depth(data: Any, limit: int = MAX_DEPTH, *, level: int = 1) -> None:
    """400 when ``data`` (a container at nesting ``level``) nests containers more than ``limit``
    levels deep.

    Iterative and visits containers only (strings and numbers are never descended into)."""
    stack: list[tuple[Any, int]] = [(data, level)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            raise bad_request(f"request body is nested more than {limit} levels deep", code="invalid_value")
        children = node.values() if isinstance(node, dict) else node
        for child in children:
            if isinstance(child, (dict, list)) and child:
                stack.append((child, depth + 1))


def parse_json_body(raw: bytes) -> dict[str, Any]:
    data = parse_json_object(raw)
    check_body_depth(raw, data)
    return data


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, its nesting not yet checked (``check_body_depth``)."""
    if not raw:
        raise bad_request("request body is empty; expected a JSON object", code="invalid_json")
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    return data


def check_body_depth(raw: bytes, data: dict[str, Any], *, items: str | None = None, checked: int = 0) -> None:
    """400 when the body nests deeper than ``MAX_DEPTH``. ``data[items][:checked]`` are left
    out: items equal to ones an earlier request was checked with (``history_memo``)."""
    # Nesting deeper than MAX_DEPTH needs more than MAX_DEPTH opening brackets: counting them
    # clears a short body for less than the walk. A long one is walked: on the parsed value, its
    # cost follows the number of containers (a few per message), not the bytes (counting brackets
    # in a 400 KB body costs more than parsing it).
    if len(raw) <= SHORT_BODY and raw.count(b"{") + raw.count(b"[") <= MAX_DEPTH:
        return
    if not checked:
        check_depth(data)
        return
    check_depth({k: v for k, v in data.items() if k != items})
    for item in data[items][checked:]:  # an item of a list under the body object sits at level 3
        if isinstance(item, (dict, list)):
            check_depth(item, level=3)


def build(fn, *args: Any) -> Any:
    """Run a dialect's request conversion; a wrong type anywhere in the body is a 400, not a 500.

    The conversions check what they know; a value of a type nobody expected (a list where a
    string belongs, ...) surfaces as one of these exceptions before any work was done."""
    try:
        return fn(*args)
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
        raise bad_request(f"invalid request body: unexpected value ({type(exc).__name__}: {exc})"[:300], code="invalid_value") from None


def _inline_refs(schema: dict[str, Any]) -> dict[str, Any]:
    """A pydantic JSON schema with its ``$defs`` inlined (request models are not recursive), so it
    can sit anywhere in an OpenAPI document."""
    defs = schema.get("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return walk(defs[ref.rsplit("/", 1)[1]])
            return {k: walk(v) for k, v in node.items() if k != "$defs"}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return walk(schema)


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` documenting a route's JSON request body (routes read raw bodies)."""
    schema = _inline_refs(model.model_json_schema())
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _loc(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


_BRANCHES = {"str", "list", "dict", "int", "float", "bool", "function-after", "list[str]", "list[dict[str,any]]"}


def validate(model: type[BaseModel], data: Any) -> Any:
    """``model.model_validate`` with pydantic errors turned into an OpenAI-shaped 400."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errs = e.errors(include_url=False)
        first = errs[0]
        # a union reports one error per branch; keep the location without the branch name
        loc = tuple(p for p in first.get("loc", ()) if not (isinstance(p, str) and ("[" in p or p in _BRANCHES)))
        where = _loc(loc) or "body"
        msg = first.get("msg", "invalid value")
        more = f" (and {len(errs) - 1} more error(s))" if len(errs) > 1 else ""
        raise APIError(400, f"invalid value for '{where}': {msg}{more}", code="invalid_value", param=where) from None


async def read_model(request, model: type[BaseModel]) -> Any:
    """Parse and validate a request body in one step."""
    return validate(model, parse_json_body(await request.body()))
