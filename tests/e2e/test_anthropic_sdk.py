"""The official ``anthropic`` SDK against ``splice serve`` + the reference engine (script mode):
a streamed multi-turn tool loop with thinking, later turns spliced whether or not the client
replays the thinking, both auth headers, Anthropic-shaped errors, sessions listed, metrics."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

pytestmark = pytest.mark.slow

KEY = "sk-splice-test"
CALL = (
    "<think>\nI need the weather.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>'
)
DONE = "<think>\nGot it.\n</think>\n\nIt is 3 degrees in Oslo.<|im_end|>"
TOOLS = [
    {"name": "get_weather", "description": "Weather for a city",
     "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
    {"type": "web_search_20250305", "name": "web_search"},
]  # fmt: skip


def _loop(client, session: str, keep_thinking: bool) -> None:
    history = [{"role": "user", "content": "Weather in Oslo?"}]
    with client.messages.stream(model="splice-model", max_tokens=200, messages=history, tools=TOOLS,
                                extra_headers={"X-Session-Id": session, "X-Group-Id": "g-oslo"}) as s:  # fmt: skip
        m1 = s.get_final_message()
        # the SDK drops the splice block of a stream; the session is in the response headers
        assert s.response.headers["x-splice-session-id"] == session
    assert m1.stop_reason == "tool_use" and [b.type for b in m1.content] == ["thinking", "tool_use"]
    blocks = [b.model_dump(exclude_none=True) for b in m1.content if keep_thinking or b.type != "thinking"]
    call = m1.content[-1]
    history += [
        {"role": "assistant", "content": blocks},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "3 degrees"}]},
    ]
    m2 = client.messages.create(model="splice-model", max_tokens=200, messages=history, tools=TOOLS,
                                extra_headers={"X-Session-Id": session})  # fmt: skip
    assert m2.stop_reason == "end_turn" and m2.content[-1].text == "It is 3 degrees in Oslo."
    assert m2.model_extra["splice"]["spliced"] is True
    assert m2.model_extra["splice"]["tools_not_offered"] == ["web_search_20250305"]


def _check_spliced(proxy, session: str) -> None:
    s = proxy.get(f"/v1/sessions/{session}").json()
    turns = s["turns"]
    assert len(turns) == 2 and turns[1]["spliced"] and s["group_id"] == "g-oslo"
    full = turns[0]["prompt_ids"] + turns[0]["output_ids"]
    assert turns[1]["prompt_ids"][: len(full)] == full
    assert turns[0]["requested_sampling"]["tools_not_offered"] == ["web_search_20250305"]


def test_anthropic_sdk_tool_loop_spliced(proxy_factory):
    proxy = proxy_factory(script=[CALL, DONE], delay_ms=1, extra=["--api-key", KEY])
    client = anthropic.Anthropic(base_url=proxy.url, api_key=KEY, max_retries=0, timeout=120)  # x-api-key
    _loop(client, "oslo-1", keep_thinking=True)
    _check_spliced(proxy, "oslo-1")
    # a client that drops the thinking blocks still splices: the sampled ids keep them
    bearer = anthropic.Anthropic(base_url=proxy.url, auth_token=KEY, max_retries=0, timeout=120)  # Authorization: Bearer
    _loop(bearer, "oslo-2", keep_thinking=False)
    _check_spliced(proxy, "oslo-2")

    # count_tokens is the full render's length
    n = client.messages.count_tokens(model="m", messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=TOOLS)
    first = proxy.get("/v1/sessions/oslo-1").json()["turns"][0]
    assert n.input_tokens == len(first["prompt_ids"])

    # errors: Anthropic's shape on the Messages routes, OpenAI's elsewhere
    r = httpx.post(proxy.url + "/v1/messages", json={"model": "m", "max_tokens": 5, "messages": []})
    assert r.status_code == 401 and r.json() == {"type": "error", "error": {"type": "authentication_error", "message": r.json()["error"]["message"]}}
    r = httpx.post(proxy.url + "/v1/responses", json={"model": "m", "input": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(anthropic.BadRequestError) as ei:
        client.messages.create(model="m", max_tokens=5, messages=[{"role": "assistant", "content": [{"type": "image", "source": {}}]}])
    assert ei.value.body["type"] == "error" and ei.value.body["error"]["type"] == "invalid_request_error"
    proxy.post("/v1/sessions/oslo-1/reward", {"reward": 1.0})
    with pytest.raises(anthropic.ConflictError):
        client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}], extra_headers={"X-Session-Id": "oslo-1"})

    # the sessions a harness produced, listed and paged
    listed = proxy.get("/v1/sessions").json()
    assert [s["session_id"] for s in listed["data"]] == ["oslo-1", "oslo-2"] and listed["has_more"] is False
    assert listed["data"][0]["turns"] == 2 and listed["data"][0]["closed"] is True
    page = proxy.get("/v1/sessions?limit=1&group_id=g-oslo").json()
    assert [s["session_id"] for s in page["data"]] == ["oslo-1"] and page["has_more"]
    nxt = proxy.get(f"/v1/sessions?limit=1&group_id=g-oslo&cursor={page['next_cursor']}").json()
    assert [s["session_id"] for s in nxt["data"]] == ["oslo-2"] and nxt["next_cursor"] is None
    assert [s["session_id"] for s in proxy.get("/v1/sessions?status=open").json()["data"]] == ["oslo-2"]
    since = listed["data"][1]["created_at"]
    assert [s["session_id"] for s in proxy.get(f"/v1/sessions?since={since}").json()["data"]] == ["oslo-2"]
    assert proxy.get("/v1/sessions?cursor=garbage").status_code == 400

    metrics = proxy.get("/metrics").text
    assert 'splice_tools_not_offered_total{type="web_search_20250305"} 4.0' in metrics
    assert 'splice_turns_total{api="messages"} 4.0' in metrics


def test_default_output_budget_is_what_fits(proxy_factory):
    long = " ".join(["word"] * 1500) + "<|im_end|>"
    proxy = proxy_factory(script=[long])
    r = proxy.post("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "talk"}]})
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "stop" and body["usage"]["completion_tokens"] > 1024
    capped = proxy_factory(script=[long], extra=["--max-output-tokens", "64"])
    r = capped.post("/v1/responses", {"model": "m", "input": "talk", "max_output_tokens": 500})
    assert r.json()["status"] == "incomplete" and r.json()["usage"]["output_tokens"] == 64
    assert json.loads(json.dumps(r.json()["splice"]))["finish_reason"] == "length"
