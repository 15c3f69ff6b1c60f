"""JSON in and out for every route: orjson both ways, pydantic errors as OpenAI-shaped 400s."""

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


def parse_json_body(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise bad_request("request body is empty; expected a JSON object", code="invalid_json")
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    return data


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
