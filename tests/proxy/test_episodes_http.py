"""Episodes as a trainer needs them, over real HTTP: the proxy app served by uvicorn on loopback
in front of the reference engine (script mode, real tiny Qwen3-architecture model, real Qwen3
tokenizer and chat template), requests shaped like Claude Code 2.1.197 (title request first,
system text and tool-description edits between ``-p`` and ``--continue``, a Task sub-agent, its
summarise-then-restart compaction) and like Codex (inline compaction, the remote
``/v1/responses/compact`` and ``compaction_trigger`` forms).

Checked: every call's role; with ``--history-edits keep`` no ``history_edited`` fork; after one
reward a pull gives exactly one trainable sample per main / sub-agent / compacted segment and
none for the auxiliary call; the restarted history carries the summary's sampled ids; GRPO
advantages over the pulled samples against a hand computation."""

from __future__ import annotations

import json
import socket
import threading
import time

from pathlib import Path

import httpx
import pytest
from jsonschema import Draft202012Validator

SAMPLE_SCHEMA = json.loads((Path(__file__).parents[2] / "proxy" / "schemas" / "sample.schema.json").read_text())


BASH_CALL = '<tool_call>\n{"name": "Bash", "arguments": {"command": "ls"}}\n</tool_call>'
TASK_CALL = '<tool_call>\n{"name": "Task", "arguments": {"description": "count", "prompt": "Count the files in the repo.", "subagent_type": "general-purpose"}}\n</tool_call>'
SHELL_CALL = '<tool_call>\n{"name": "shell", "arguments": {"command": ["cat", "bug.py"]}}\n</tool_call>'
CC_SUMMARY = "The user asked to list the files and to count them. A sub-agent counted 2 files. Nothing remains."
CODEX_SUMMARY = "Goal: fix the bug in bug.py. Progress: read the file, patched the off-by-one. Next: run the tests."
REMOTE_SUMMARY = "Goal: fix the bug. The patch is in and the tests were started; check their result."

CLAUDE_SCRIPT = [
    '{"title": "List files"}',  # title request (auxiliary)
    BASH_CALL,  # claude -p: the agent runs ls
    "Two files: a.txt and b.txt.",  # after the tool result
    TASK_CALL,  # claude --continue: the agent starts a sub-agent
    "There are 2 files.",  # the sub-agent's answer
    "The repo has 2 files.",  # main, after the Task result
    CC_SUMMARY,  # the compaction summary
    "Continuing from the summary: 2 files, done.",  # the restarted conversation
]
CODEX_SCRIPT = [
    SHELL_CALL,
    "Patched the off-by-one.",
    CODEX_SUMMARY,  # inline compaction
    "Running the tests now.",  # restarted from the summary
    "Tests started.",  # next turn of the compacted segment
    REMOTE_SUMMARY,  # POST /v1/responses/compact
    "Checked: the tests pass.",  # restarted from the compaction item
    REMOTE_SUMMARY + " They pass.",  # compaction_trigger
]


def _serve(app) -> tuple[str, callable]:
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)

    def stop():
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()

    return url, stop


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from engines.reference.model_init import init_model

    return init_model(tmp_path_factory.mktemp("episodes") / "model", max_position_embeddings=8192)


def _proxy(model_dir, tmp_path, script, **settings):
    from engines.pool import EnginePool
    from engines.reference.testing import start_engine_in_thread
    from proxy.app import create_app
    from proxy.settings import Settings
    from tokenization import ChatFormat, load_tokenizer

    engine_url, stop_engine = start_engine_in_thread(model_dir, script=script)
    fmt = ChatFormat(load_tokenizer(str(model_dir)), "qwen3")
    app = create_app(Settings(store=str(tmp_path / "s.sqlite"), history_edits="keep", **settings), fmt=fmt,
                     pool=EnginePool("sglang", [engine_url], health_interval_s=0))  # fmt: skip
    url, stop_proxy = _serve(app)

    def stop():
        stop_proxy()
        stop_engine()

    return url, fmt, stop


# ------------------------------------------------------------------ Claude Code 2.1.197 shapes

CC_SYSTEM = "You are Claude Code, Anthropic's official CLI for Claude. Use the tools to help the user.\nModel: {model}"
SUB_SYSTEM = "You are an agent for Claude Code. Given the user's message, use the tools available to complete the task."


def _bash(footer: str) -> dict:
    return {"name": "Bash", "description": f"Run a shell command. Commit footer: Co-Authored-By: {footer}",
            "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}  # fmt: skip


TASK = {"name": "Task", "description": "Launch a sub-agent for a task.",
        "input_schema": {"type": "object", "properties": {"description": {"type": "string"}, "prompt": {"type": "string"},
                                                           "subagent_type": {"type": "string"}}}}  # fmt: skip


def _system(text: str) -> list[dict]:
    return [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197; cc_entrypoint=sdk-cli;"},
            {"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}]  # fmt: skip


def test_claude_code_episode(model_dir, tmp_path):
    url, fmt, stop = _proxy(model_dir, tmp_path, CLAUDE_SCRIPT)
    sid = "0b0e5f4c-claude-episode"
    h = {"X-Claude-Code-Session-Id": sid, "anthropic-version": "2023-06-01"}
    c = httpx.Client(base_url=url, timeout=60, headers=h)
    try:

        def post(body):
            r = c.post("/v1/messages", json={"max_tokens": 256, **body})
            assert r.status_code == 200, r.text
            return r.json()

        # 1. the title request: its own short system prompt, no tools, a JSON-schema output_config, a small model
        title = post({"model": "claude-3-5-haiku-20241022", "system": [{"type": "text", "text": "Generate a short title for the conversation."}],
                      "messages": [{"role": "user", "content": "list the files"}],
                      "output_config": {"format": {"type": "json_schema", "schema": {"type": "object", "properties": {"title": {"type": "string"}}}}}})  # fmt: skip
        # 2. claude -p: the agent's conversation
        main = {"model": "claude-sonnet-4-5", "system": _system(CC_SYSTEM.format(model="claude-sonnet-4-5")), "tools": [_bash("Claude Sonnet 4.5"), TASK]}
        user0 = {"role": "user", "content": [{"type": "text", "text": "list the files"}]}
        r1 = post({**main, "messages": [user0]})
        tu = next(b for b in r1["content"] if b["type"] == "tool_use")
        hist = [user0, {"role": "assistant", "content": r1["content"]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tu["id"], "content": "a.txt\nb.txt"}]}]  # fmt: skip
        r2 = post({**main, "messages": hist})
        hist.append({"role": "assistant", "content": r2["content"]})
        # 3. claude --continue: the harness edited its system text AND the Bash tool's description
        cont = {**main, "system": _system(CC_SYSTEM.format(model="claude-sonnet-4-5[1m]")), "tools": [_bash("Claude Sonnet 4.5 (1M)"), TASK]}
        hist.append({"role": "user", "content": "now count them"})
        r3 = post({**cont, "messages": hist})
        assert r3["splice"]["spliced"] and set(r3["splice"]["history_edits"]) == {"system_text", "tools"}
        task = next(b for b in r3["content"] if b["type"] == "tool_use")
        assert task["name"] == "Task"
        # 4. the Task sub-agent: a fresh conversation with its own system prompt and tools
        rs = post({"model": "claude-sonnet-4-5", "system": _system(SUB_SYSTEM), "tools": [_bash("Claude Sonnet 4.5 (1M)")],
                   "messages": [{"role": "user", "content": task["input"]["prompt"]}]})  # fmt: skip
        hist += [{"role": "assistant", "content": r3["content"]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": task["id"], "content": rs["content"][0]["text"]}]}]  # fmt: skip
        r4 = post({**cont, "messages": hist})
        hist.append({"role": "assistant", "content": r4["content"]})
        # 5. compaction: the history, the summariser's system prompt, no tools, the summary instruction last
        summ = post({"model": "claude-sonnet-4-5", "system": [{"type": "text", "text": "You are a helpful AI assistant tasked with summarizing conversations."}],
                     "messages": hist + [{"role": "user", "content": "CRITICAL: Respond with TEXT ONLY. Do NOT call any tools.\n\n"
                                          "Your task is to create a detailed summary of the conversation so far, paying close attention to the user's requests."}]})  # fmt: skip
        assert summ["splice"]["spliced"] and summ["splice"]["fork_reason"] is None
        summary = summ["content"][0]["text"]
        assert summary == CC_SUMMARY
        # 6. the restarted conversation holds the summary
        restart = post({**cont, "messages": [{"role": "user", "content": "This session is being continued from a previous conversation that ran out of "
                                              f"context. The conversation is summarized below:\n{summary}\nPlease continue the conversation."}]})  # fmt: skip

        turns = c.get(f"/v1/sessions/{sid}").json()["turns"]
        roles = [t["role"] for t in turns]
        assert roles == ["auxiliary", "main", "main", "main", "subagent", "main", "main", "compacted"]
        assert not any(t["fork_reason"] == "history_edited" for t in turns)
        assert [t["spliced"] for t in turns] == [False, False, True, True, False, True, True, False]
        assert turns[0]["requested_sampling"]["role_reason"] == "structured_output"
        assert turns[6]["requested_sampling"]["compaction"] == "summary"
        # the restart continues from the summary turn, whose sampled ids its prompt carries
        r, s = turns[7], turns[6]
        assert r["parent_turn_id"] == s["turn_id"] and r["requested_sampling"]["summary_ids"] == "carried"
        summary_ids = s["output_ids"][: -1]  # without the stop token
        assert fmt.tokenizer.decode(summary_ids) == CC_SUMMARY
        assert any(r["prompt_ids"][i : i + len(summary_ids)] == summary_ids for i in range(len(r["prompt_ids"])))
        assert title["splice"]["spliced"] is False and restart["splice"]["fork_reason"] is None

        metrics = c.get("/metrics").text
        assert 'splice_turn_roles_total{role="auxiliary"} 1.0' in metrics
        assert 'splice_turn_roles_total{role="subagent"} 1.0' in metrics
        assert 'splice_turn_roles_total{role="compacted"} 1.0' in metrics

        assert c.post(f"/v1/sessions/{sid}/reward", json={"reward": 1.0}).status_code == 200
        pulled = c.post("/v1/trajectories/pull", json={"max_samples": 64}).json()
        Draft202012Validator(SAMPLE_SCHEMA).validate(pulled)  # proxy/schemas/sample.schema.json, version 3
        samples = pulled["samples"]
        assert sorted(x["role"] for x in samples) == ["compacted", "main", "subagent"]
        assert all(x["trainable"] and x["reward"] == 1.0 for x in samples)
        by_role = {x["role"]: x for x in samples}
        assert by_role["main"]["turn_ids"] == [turns[i]["turn_id"] for i in (1, 2, 3, 5, 6)]
        assert by_role["subagent"]["turn_ids"] == [turns[4]["turn_id"]]
        assert by_role["compacted"]["turn_ids"] == [turns[7]["turn_id"]]
        assert all(t["role"] == x["role"] for x in samples for t in x["turns"])
    finally:
        c.close()
        stop()


def test_claude_code_2_1_330_episode(model_dir, tmp_path):
    """Claude Code 2.1.330: no title request; the system text edited at ``--continue``; its
    compaction keeps the main system prompt and tools (cache reuse) and ends with the summary
    instruction; the restart formats the summary behind "Summary:"."""
    script = [BASH_CALL, "Two files: a.txt and b.txt.", "Counted: 2.", CC_SUMMARY, "Continuing: 2 files."]
    url, fmt, stop = _proxy(model_dir, tmp_path, script)
    sid = "5d1c2a7e-claude-330"
    c = httpx.Client(base_url=url, timeout=60, headers={"X-Claude-Code-Session-Id": sid})
    try:

        def post(body):
            r = c.post("/v1/messages", json={"model": "claude-sonnet-4-5", "max_tokens": 256, **body})
            assert r.status_code == 200, r.text
            return r.json()

        tools = [_bash("Claude"), TASK]
        hist = [{"role": "user", "content": "list the files"}]
        r1 = post({"system": _system(CC_SYSTEM.format(model="a")), "tools": tools, "messages": hist})
        tu = r1["content"][-1]
        hist += [{"role": "assistant", "content": r1["content"]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tu["id"], "content": "a.txt\nb.txt"}]}]  # fmt: skip
        r2 = post({"system": _system(CC_SYSTEM.format(model="a")), "tools": tools, "messages": hist})
        hist += [{"role": "assistant", "content": r2["content"]}, {"role": "user", "content": "count them"}]
        edited = _system(CC_SYSTEM.format(model="b"))
        r3 = post({"system": edited, "tools": tools, "messages": hist})
        assert r3["splice"]["spliced"] and r3["splice"]["history_edits"] == ["system_text"]
        hist.append({"role": "assistant", "content": r3["content"]})
        summ = post({"system": edited, "tools": tools, "messages": hist + [
            {"role": "user", "content": "CRITICAL: Respond with TEXT ONLY. Do NOT call any tools.\n\nYour task is to create a detailed summary of the conversation so far."}]})  # fmt: skip
        assert summ["splice"]["spliced"] and summ["splice"]["history_edits"] == []
        post({"system": edited, "tools": tools, "messages": [
            {"role": "user", "content": "This session is being continued from a previous conversation that ran out of context. "
                                        f"The conversation is summarized below:\nSummary:\n{summ['content'][0]['text']}"}]})  # fmt: skip
        turns = c.get(f"/v1/sessions/{sid}").json()["turns"]
        assert [t["role"] for t in turns] == ["main"] * 4 + ["compacted"]
        assert [t["spliced"] for t in turns] == [False, True, True, True, False] and all(t["fork_reason"] is None for t in turns)
        assert turns[4]["parent_turn_id"] == turns[3]["turn_id"] and turns[4]["requested_sampling"]["summary_ids"] == "carried"
        c.post(f"/v1/sessions/{sid}/reward", json={"reward": 0.0})
        samples = c.post("/v1/trajectories/pull", json={"max_samples": 64}).json()["samples"]
        assert [(x["role"], len(x["turn_ids"])) for x in samples] == [("main", 4), ("compacted", 1)]
    finally:
        c.close()
        stop()


def test_train_auxiliary_hands_side_calls_out(model_dir, tmp_path):
    """``--train-auxiliary``: the title request is a sample of its own (same episode reward)."""
    url, _fmt, stop = _proxy(model_dir, tmp_path, CLAUDE_SCRIPT, train_auxiliary=True)
    h = {"X-Session-Id": "aux"}
    try:
        with httpx.Client(base_url=url, timeout=60, headers=h) as c:
            r = c.post("/v1/messages", json={"model": "claude-3-5-haiku-20241022", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}],
                                             "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}})  # fmt: skip
            assert r.status_code == 200
            r = c.post("/v1/messages", json={"model": "m", "max_tokens": 64, "tools": [TASK], "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200
            # a harness that says what its call is
            r = c.post("/v1/messages", json={"model": "m", "max_tokens": 64, "tools": [TASK], "messages": [{"role": "user", "content": "quota"}]},
                       headers={"X-Splice-Role": "auxiliary"})  # fmt: skip
            assert r.status_code == 200
            assert c.post("/v1/messages", json={"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]},
                          headers={"X-Splice-Role": "judge"}).status_code == 400  # fmt: skip
            assert [t["role"] for t in c.get("/v1/sessions/aux").json()["turns"]] == ["auxiliary", "main", "auxiliary"]
            c.post("/v1/sessions/aux/reward", json={"reward": 0.5})
            samples = c.post("/v1/trajectories/pull", json={"max_samples": 64}).json()["samples"]
            assert sorted(x["role"] for x in samples) == ["auxiliary", "auxiliary", "main"]
            assert all(x["trainable"] and x["reward"] == 0.5 for x in samples)
    finally:
        stop()


# ------------------------------------------------------------------ Codex shapes

SHELL = {"type": "function", "name": "shell", "description": "Runs a shell command.",
         "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}}, "required": ["command"]}}  # fmt: skip
INSTRUCTIONS = "You are Codex, a coding agent. Use the shell tool."


def _user(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def _assistant(text: str) -> dict:
    return {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}


def _sse_items(text: str) -> list[dict]:
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]
    return [e for e in events if e["type"] == "response.output_item.done"], events


def test_codex_episode_with_inline_and_remote_compaction(model_dir, tmp_path):
    url, fmt, stop = _proxy(model_dir, tmp_path, CODEX_SCRIPT)
    thread = "019a7c1e-codex-thread"
    c = httpx.Client(base_url=url, timeout=60, headers={"session-id": thread})
    try:

        def post(input_, tools=(SHELL,), path="/v1/responses", **kw):
            r = c.post(path, json={"model": "gpt-5-codex", "instructions": INSTRUCTIONS, "input": input_, "tools": list(tools),
                                   "store": False, **kw})  # fmt: skip
            assert r.status_code == 200, r.text
            return r

        env = _user("<environment_context>cwd: /repo</environment_context>")
        hist = [env, _user("fix the bug in bug.py")]
        r1 = post(hist).json()
        call = next(o for o in r1["output"] if o["type"] == "function_call")
        hist += [call, {"type": "function_call_output", "call_id": call["call_id"], "output": "for i in range(n + 1):"}]
        r2 = post(hist).json()
        hist.append(_assistant(r2["output"][-1]["content"][0]["text"]))
        # inline compaction: the history resent with no tools and the summary instruction last
        r3 = post(hist + [_user("You are performing a CONTEXT CHECKPOINT COMPACTION. Create a handoff summary for another LLM that will resume the task.")],
                  tools=()).json()  # fmt: skip
        assert r3["splice"]["spliced"] and r3["splice"]["fork_reason"] is None
        summary = r3["output"][-1]["content"][0]["text"]
        assert summary == CODEX_SUMMARY
        # the restarted history: the user messages kept, then the summary behind Codex's prefix
        seg = [env, _user("fix the bug in bug.py"),
               _user("Another language model started to solve this problem and produced a summary of its thinking process. "
                     f"Here is the summary produced by the other language model:\n{summary}")]  # fmt: skip
        r4 = post(seg).json()
        assert r4["splice"]["fork_reason"] is None
        seg += [_assistant(r4["output"][-1]["content"][0]["text"]), _user("run the tests")]
        r5 = post(seg).json()
        assert r5["splice"]["spliced"]
        seg.append(_assistant(r5["output"][-1]["content"][0]["text"]))
        # remote compaction: POST /v1/responses/compact
        rc = post(seg, path="/v1/responses/compact").json()
        assert rc["object"] == "response.compaction" and rc["splice"]["spliced"]
        cmp_item = rc["output"][-1]
        assert cmp_item["type"] == "compaction" and isinstance(cmp_item["encrypted_content"], str)
        assert [o["type"] for o in rc["output"][:-1]] == ["message"] * (len(rc["output"]) - 1)
        # later turns send the item back in place of the history it replaced
        after = [*rc["output"][:-1], cmp_item, _user("check the tests")]
        r6 = post(after).json()
        assert r6["splice"]["fork_reason"] is None
        after.append(_assistant(r6["output"][-1]["content"][0]["text"]))
        # the body-signal form: a compaction_trigger item last, streamed, one compaction item back
        r7 = post(after + [{"type": "compaction_trigger"}], stream=True)
        done, events = _sse_items(r7.text)
        assert [d["item"]["type"] for d in done] == ["compaction"] and events[-1]["type"] == "response.completed"
        assert events[-1]["response"]["output"] == [done[0]["item"]]
        # a compaction item Splice did not issue is a clear 400
        bad = c.post("/v1/responses", json={"model": "m", "input": [{"type": "compaction", "encrypted_content": "gAAAA"}, _user("x")]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "input[0].encrypted_content"

        turns = c.get(f"/v1/sessions/{thread}").json()["turns"]
        assert [t["role"] for t in turns] == ["main", "main", "main", "compacted", "compacted", "compacted", "compacted", "compacted"]
        assert [t["spliced"] for t in turns] == [False, True, True, False, True, True, False, True]
        assert all(t["fork_reason"] is None for t in turns)
        assert turns[3]["parent_turn_id"] == turns[2]["turn_id"] and turns[6]["parent_turn_id"] == turns[5]["turn_id"]
        assert turns[3]["requested_sampling"]["summary_ids"] == "carried" == turns[6]["requested_sampling"]["summary_ids"]
        assert [t["requested_sampling"].get("compaction") for t in turns] == [None, None, "summary", "restart", None, "summary", "restart", "summary"]

        assert c.post(f"/v1/sessions/{thread}/reward", json={"reward": 1.0}).status_code == 200
        samples = c.post("/v1/trajectories/pull", json={"max_samples": 64}).json()["samples"]
        assert [(x["role"], len(x["turn_ids"])) for x in samples] == [("main", 3), ("compacted", 3), ("compacted", 2)]
        assert all(x["trainable"] for x in samples)
    finally:
        c.close()
        stop()


def test_grpo_advantages_per_episode_over_pulled_samples(model_dir, tmp_path):
    """A group of three episodes; one of them yields two samples (main + sub-agent). The pulled
    samples' advantages match the hand computation over episodes, not samples."""
    from trainer_bridge.advantages import group_advantages

    script = [TASK_CALL, "Sub-agent done.", "Main done.", "Episode two.", "Episode three."]
    url, _fmt, stop = _proxy(model_dir, tmp_path, script)
    tools = [_bash("x"), TASK]
    try:
        with httpx.Client(base_url=url, timeout=60) as c:

            def post(session, body):
                r = c.post("/v1/messages", json={"model": "m", "max_tokens": 128, **body}, headers={"X-Session-Id": session, "X-Group-Id": "g"})
                assert r.status_code == 200, r.text
                return r.json()

            u = {"role": "user", "content": "count the files"}
            r = post("e1", {"system": "main agent", "tools": tools, "messages": [u]})
            task = next(b for b in r["content"] if b["type"] == "tool_use")
            sub = post("e1", {"system": "sub agent", "tools": tools[:1], "messages": [{"role": "user", "content": task["input"]["prompt"]}]})
            post("e1", {"system": "main agent", "tools": tools, "messages": [
                u, {"role": "assistant", "content": r["content"]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": task["id"], "content": sub["content"][0]["text"]}]}]})  # fmt: skip
            post("e2", {"system": "main agent", "tools": tools, "messages": [u]})
            post("e3", {"system": "main agent", "tools": tools, "messages": [u]})
            for sid, reward in (("e1", 1.0), ("e2", 0.0), ("e3", 0.5)):
                c.post(f"/v1/sessions/{sid}/reward", json={"reward": reward})
            samples = c.post("/v1/trajectories/pull", json={"max_samples": 64}).json()["samples"]
        assert sorted((x["session_id"], x["role"]) for x in samples) == [("e1", "main"), ("e1", "subagent"), ("e2", "main"), ("e3", "main")]
        adv = dict(zip(((x["session_id"], x["role"]) for x in samples), group_advantages(samples, eps=0.0)))
        # by hand: episode rewards 1, 0, 0.5 -> mean 0.5, population std sqrt(1/6) = 0.40824829...
        assert adv[("e1", "main")] == adv[("e1", "subagent")] == pytest.approx(0.5 / 0.408248290463863, abs=1e-12)
        assert adv[("e2", "main")] == pytest.approx(-1.224744871391589, abs=1e-12)
        assert adv[("e3", "main")] == pytest.approx(0.0, abs=1e-12)
    finally:
        stop()
