"""The real Codex CLI and Claude Code CLI, with their default tools, against ``splice serve``
(embedded reference engine in script mode emitting a call of each CLI's shell tool): the CLI
runs the command, gets the answer, resumes the conversation, and every later turn is spliced.
``test_first_try_from_the_readme`` runs the README's first-try commands as written against the
default ``splice serve`` (the bundled model's scripted first-try reply).
``test_codex_cli_auto_compaction`` lets Codex compact its history on its own (a low
``model_auto_compact_token_limit``) and checks the episode Splice records from it.

The npm packages are installed on first use under ``.cache/agent-clis`` (gitignored); without
npm or the registry the tests skip. The proxy is the default ``splice serve`` (no model flags):
the bundled tiny model's 128k context holds both CLIs' ~8-21k-token system prompt and tool
list. Each test takes ~20-40 s on an idle machine (the first one also creates the model).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import ROOT, start_proxy
from tokenization.loader import load_tokenizer

pytestmark = pytest.mark.slow

# SPLICE_AGENT_CLIS: another npm prefix holding the CLIs (e.g. an older Claude Code, installed with
# `npm install --prefix DIR @anthropic-ai/claude-code@2.1.197`) to run these tests against it
CACHE = Path(os.environ.get("SPLICE_AGENT_CLIS") or ROOT / ".cache" / "agent-clis")
START_S = 600  # splice serve's start (engine included) on a loaded shared machine can pass 2 minutes
PACKAGES = {"codex": "@openai/codex@0.169.0", "claude": "@anthropic-ai/claude-code@2.1.330"}


def cli(name: str) -> str:
    """Path of the CLI's binary, installing the pinned npm package on first use."""
    exe = CACHE / "node_modules" / ".bin" / name
    if exe.exists():
        return str(exe)
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed")
    CACHE.mkdir(parents=True, exist_ok=True)
    r = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(CACHE), PACKAGES[name]],
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    if r.returncode != 0 or not exe.exists():
        pytest.skip(f"cannot install {PACKAGES[name]}: {r.stderr[-500:]}")
    return str(exe)


@pytest.fixture(scope="module")
def splice_home(tmp_path_factory) -> dict:
    """A fresh ``$SPLICE_HOME`` holding the bundled default model, created here as ``splice serve``
    would on first use (up front, so a loaded machine does not run a server's start past its deadline)."""
    from engines.reference.model_init import BUNDLED_MODEL_NAME, ensure_model

    home = tmp_path_factory.mktemp("splice-home")
    ensure_model(home / "models" / BUNDLED_MODEL_NAME)
    return {"SPLICE_HOME": str(home)}


def _default_model(home: dict) -> str:
    from engines.reference.model_init import BUNDLED_MODEL_NAME

    return str(Path(home["SPLICE_HOME"]) / "models" / BUNDLED_MODEL_NAME)


def _turns(proxy, session: str) -> list[dict]:
    r = proxy.get(f"/v1/sessions/{session}")  # with the proxy's admin token
    assert r.status_code == 200, r.text
    return r.json()["turns"]


def _all_spliced(turns: list[dict]) -> None:
    assert turns[0]["fork_reason"] is None
    for prev, cur in zip(turns, turns[1:]):
        assert cur["spliced"], cur["fork_reason"]
        full = prev["prompt_ids"] + prev["output_ids"]
        assert cur["prompt_ids"][: len(full)] == full


def _bridge_text(model_dir: str, turns: list[dict]) -> str:
    """The text of the tokens turn 1 added after turn 0's prompt and output (the tool result)."""
    from tokenization.loader import load_tokenizer

    full = turns[0]["prompt_ids"] + turns[0]["output_ids"]
    return load_tokenizer(model_dir).decode(turns[1]["prompt_ids"][len(full) :])


def _run(args: list[str], cwd: Path, env: dict) -> str:
    r = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    return out


CODEX_SCRIPT = [
    "<think>\nI should run the command.\n</think>\n\n"
    '<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "echo splice-ok"}}\n</tool_call><|im_end|>',
    "<think>\nThe command printed splice-ok.\n</think>\n\nThe command printed: splice-ok<|im_end|>",
    "Resumed: still splice-ok.<|im_end|>",
]

CODEX_CONFIG = """model = "gpt-5.5"
model_provider = "splice"
approval_policy = "never"
sandbox_mode = "workspace-write"

[model_providers.splice]
name = "Splice"
base_url = "{url}/v1"
wire_api = "responses"
env_http_headers = {{ "X-Session-Id" = "SPLICE_SESSION", "X-Group-Id" = "SPLICE_GROUP" }}
"""


def test_codex_cli_default_tools(tmp_path, splice_home):
    codex = cli("codex")
    proxy = start_proxy(tmp_path, None, script=CODEX_SCRIPT, env=splice_home, start_timeout_s=START_S)
    try:
        home, work = tmp_path / "codex-home", tmp_path / "work"
        home.mkdir()
        work.mkdir()
        (home / "config.toml").write_text(CODEX_CONFIG.format(url=proxy.url))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "SPLICE_", "CODEX_"))}
        env["CODEX_HOME"] = str(home)
        ask = [codex, "exec", "--skip-git-repo-check"]

        # zero config: no session header; Codex's own thread id names the session
        out = _run(ask + ["Run echo splice-ok and tell me what it printed."], work, env)
        assert "splice-ok\n" in out and "The command printed: splice-ok" in out
        thread = re.search(r"session id: ([0-9a-f-]{36})", out).group(1)
        out = _run(ask + ["resume", "--last", "Again?"], work, env)
        assert "Resumed: still splice-ok." in out
        turns = _turns(proxy, thread)
        assert len(turns) == 3
        _all_spliced(turns)
        assert turns[0]["requested_sampling"]["tools_not_offered"] == ["tool_search", "web_search"]
        assert "splice-ok" in _bridge_text(_default_model(splice_home), turns)  # the command's output, spliced after the call
        # a model slug Codex knows: it offers its freeform apply_patch tool, which Splice offers the model
        first_prompt = load_tokenizer(_default_model(splice_home)).decode(turns[0]["prompt_ids"])
        assert '"name": "apply_patch"' in first_prompt

        # the README recipe: per-episode session and group headers from the environment
        out = _run(ask + ["Run echo splice-ok and tell me what it printed."], work, {**env, "SPLICE_SESSION": "ep-7", "SPLICE_GROUP": "g-7"})
        assert "The command printed: splice-ok" in out
        turns = _turns(proxy, "ep-7")
        assert len(turns) == 2
        _all_spliced(turns)
        assert proxy.get("/v1/sessions?group_id=g-7").json()["data"][0]["session_id"] == "ep-7"
    finally:
        proxy.stop()
        _stop_engine(proxy)


# Codex 0.169 compacts a custom provider's conversation inline (remote compaction is for OpenAI's
# own providers): once its token count (the last response's `usage.total_tokens` plus an estimate
# of what was added since) reaches `model_auto_compact_token_limit`, it resends the history with
# no tools and its compaction prompt last, then restarts from a history that holds the user
# messages and the summary. The first prompt is ~8.1k tokens; the command's 6 kB of output
# (~1,500 tokens by Codex's estimate, 750 by the model's tokenizer) pushes the count past the
# limit before the follow-up request, and the restarted history (without that output) stays
# ~800 tokens under it, so exactly one compaction happens, inside the first `codex exec`.
COMPACT_LIMIT = 9000
CODEX_COMPACT_SUMMARY = "Summary: the user asked for 6000 a's; the command ran and printed them."
CODEX_COMPACT_SCRIPT = [
    '<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "head -c 6000 /dev/zero | tr \'\\\\0\' a"}}\n</tool_call><|im_end|>',
    CODEX_COMPACT_SUMMARY + "<|im_end|>",  # the summarisation call
    "The command printed 6000 a's.<|im_end|>",  # the restarted history's answer
    "Resumed after the compaction.<|im_end|>",
]


def test_codex_cli_auto_compaction(tmp_path, splice_home):
    """Codex's own auto-compaction: one episode, the summary call spliced onto the history it
    summarises, the restarted history a ``compacted`` segment, its later turns spliced; one
    reward, one sample per segment."""
    codex = cli("codex")
    proxy = start_proxy(tmp_path, None, script=CODEX_COMPACT_SCRIPT, env=splice_home, start_timeout_s=START_S)
    try:
        home, work = tmp_path / "codex-home", tmp_path / "work"
        home.mkdir()
        work.mkdir()
        config = CODEX_CONFIG.replace("\n[model_providers", f"model_auto_compact_token_limit = {COMPACT_LIMIT}\n\n[model_providers")
        (home / "config.toml").write_text(config.format(url=proxy.url))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "SPLICE_", "CODEX_"))}
        env.update(CODEX_HOME=str(home), SPLICE_SESSION="cx-compact", SPLICE_GROUP="g-compact")
        ask = [codex, "exec", "--skip-git-repo-check"]

        out = _run(ask + ["Print 6000 a's with a shell command."], work, env)
        assert "context compacted" in out and "The command printed 6000 a's." in out
        out = _run(ask + ["resume", "--last", "Again?"], work, env)
        assert "Resumed after the compaction." in out and "context compacted" not in out

        turns = _turns(proxy, "cx-compact")
        kinds = [t["requested_sampling"].get("compaction") for t in turns]
        assert [t["role"] for t in turns] == ["main", "main", "compacted", "compacted"], kinds
        assert kinds == [None, "summary", "restart", None]
        assert [t["fork_reason"] for t in turns] == [None] * 4
        assert [t["parent_turn_id"] for t in turns[1:]] == [t["turn_id"] for t in turns[:-1]]
        tok = load_tokenizer(_default_model(splice_home))
        # the summary call: turn 0's history spliced, the command's output and Codex's compaction
        # prompt after it, no tools offered (a dropped tool list is not a fork)
        _all_spliced(turns[:2])
        bridge = tok.decode(turns[1]["prompt_ids"][len(turns[0]["prompt_ids"]) + len(turns[0]["output_ids"]) :])
        assert "a" * 6000 in bridge and "You are performing a CONTEXT CHECKPOINT COMPACTION" in bridge
        assert turns[1]["requested_sampling"]["episode"]["tools"] == 0
        # the restart: rendered afresh (the tool output is gone), Codex's summary prefix and the
        # summary's sampled ids in its prompt; the resumed turn spliced onto it
        assert not turns[2]["spliced"] and turns[2]["requested_sampling"]["summary_ids"] == "carried"
        restart = tok.decode(turns[2]["prompt_ids"])
        assert "Another language model started to solve this problem" in restart and "a" * 6000 not in restart
        sampled = turns[1]["output_ids"][:-1]  # the summary as sampled, without its end token
        assert tok.decode(sampled) == CODEX_COMPACT_SUMMARY
        assert any(turns[2]["prompt_ids"][i : i + len(sampled)] == sampled for i in range(len(turns[2]["prompt_ids"])))
        _all_spliced(turns[2:])

        assert proxy.post("/v1/sessions/cx-compact/reward", {"reward": 1.0}).status_code == 200
        samples = proxy.post("/v1/trajectories/pull", {"max_samples": 100}).json()["samples"]
        ids = [t["turn_id"] for t in turns]
        assert sorted((x["role"], x["turn_ids"]) for x in samples) == [("compacted", ids[2:]), ("main", ids[:2])]
        assert {(x["session_id"], x["reward"]) for x in samples} == {("cx-compact", 1.0)}
        # the summary is trained once, as the end of the main sample; in the compacted one it is context
        main, compacted = sorted(samples, key=lambda x: x["role"] != "main")
        assert sum(main["loss_mask"]) == len(turns[0]["output_ids"]) + len(turns[1]["output_ids"])
        assert main["input_ids"][-len(turns[1]["output_ids"]) :] == turns[1]["output_ids"]
        assert sum(compacted["loss_mask"]) == len(turns[2]["output_ids"]) + len(turns[3]["output_ids"])
        assert compacted["input_ids"] == turns[3]["prompt_ids"] + turns[3]["output_ids"]
    finally:
        proxy.stop()
        _stop_engine(proxy)


CLAUDE_SCRIPT = [
    "<think>\nI should run the command.\n</think>\n\n"
    '<tool_call>\n{"name": "Bash", "arguments": {"command": "echo splice-ok", "description": "Print splice-ok"}}\n</tool_call><|im_end|>',
    "<think>\nIt printed splice-ok.\n</think>\n\nThe command printed: splice-ok<|im_end|>",
    "Resumed: still splice-ok.<|im_end|>",
]


TITLE_FIRST = {"2.1.197"}  # Claude Code versions whose `-p` run starts with a title request


@pytest.mark.parametrize("history_edits", [None, "keep"])
def test_claude_code_cli(tmp_path, splice_home, history_edits):
    claude = cli("claude")
    key = "sk-splice-cc"
    extra = ["--api-key", key] + (["--history-edits", history_edits] if history_edits else [])
    version = subprocess.run([claude, "--version"], capture_output=True, text=True, timeout=60).stdout.split()[0]
    # 2.1.197 asks for a session title before the first turn: the script answers it first
    script = (["Echo splice-ok<|im_end|>"] if version in TITLE_FIRST else []) + CLAUDE_SCRIPT
    proxy = start_proxy(tmp_path, None, script=script, extra=extra, env=splice_home, start_timeout_s=START_S)
    try:
        home, work = tmp_path / "home", tmp_path / "work"
        home.mkdir()
        work.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE_", "SPLICE_"))}
        env.update(
            HOME=str(home), ANTHROPIC_BASE_URL=proxy.url, ANTHROPIC_API_KEY=key,
            ANTHROPIC_CUSTOM_HEADERS="X-Session-Id: cc-ep-1\nX-Group-Id: g-cc",
        )  # fmt: skip
        out = _run([claude, "-p", "Run echo splice-ok and tell me what it printed.", "--allowedTools", "Bash"], work, env)
        assert "The command printed: splice-ok" in out
        out = _run([claude, "-p", "Again?", "--continue"], work, env)
        assert "Resumed: still splice-ok." in out
        recorded = _turns(proxy, "cc-ep-1")  # the admin token: the agent key reads no session
        # 2.1.197 first asks for a title (no tools, its own system prompt): an auxiliary side call
        side = [t for t in recorded if t["role"] != "main"]
        assert [t["role"] for t in side] == (["auxiliary"] if version in TITLE_FIRST else [])
        assert all(not t["spliced"] for t in side)
        turns = [t for t in recorded if t["role"] == "main"]
        assert len(turns) == 3
        if version in TITLE_FIRST and history_edits is None:
            # 2.1.197 rewrites its system text between `-p` and `--continue`: without `keep` the
            # resumed turn forks (docs/agents.md), with it the episode stays one spliced sample
            _all_spliced(turns[:2])
            assert turns[2]["fork_reason"] == "history_edited"
            return
        _all_spliced(turns)
        assert "splice-ok" in _bridge_text(_default_model(splice_home), turns)  # the tool really ran; its output was spliced in
        if history_edits == "keep":  # the episode is one training sample
            agent = {"Authorization": f"Bearer {key}"}
            assert proxy.post("/v1/sessions/cc-ep-1/reward", {"reward": 1.0}, headers=agent).status_code == 401
            assert proxy.post("/v1/sessions/cc-ep-1/reward", {"reward": 1.0}).status_code == 200
            samples = proxy.post("/v1/trajectories/pull", {"max_samples": 100}).json()["samples"]
            assert [x["session_id"] for x in samples] == ["cc-ep-1"]
    finally:
        proxy.stop()
        _stop_engine(proxy)


def _readme_block(name: str) -> str:
    """The bash block the README's first try shows for ``name`` (after ``<!-- first-try: name -->``)."""
    text = (ROOT / "README.md").read_text()
    m = re.search(rf"<!-- first-try: {name} -->\n```bash\n(.*?)\n```", text, re.S)
    assert m, f"README has no first-try block for {name}"
    return m.group(1)


def test_first_try_from_the_readme(tmp_path, splice_home):
    """The README's first try, verbatim, against the default ``splice serve`` (no flags but the
    port and store; a fresh ``$SPLICE_HOME``, so the bundled model is created as for a new user)
    and with no Splice, OpenAI or Anthropic variable set: every command exits 0 with the reply,
    and each CLI's two runs are one session whose second turn is spliced."""
    codex, claude = cli("codex"), cli("claude")
    proxy = start_proxy(tmp_path, None, env=splice_home, start_timeout_s=START_S)
    try:
        home, work = tmp_path / "home", tmp_path / "work"
        home.mkdir()
        work.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "ANTHROPIC_", "CLAUDE_", "CODEX_", "SPLICE_"))}
        env.update(HOME=str(home), PATH=os.pathsep.join([str(Path(codex).parent), env.get("PATH", "")]))
        assert Path(claude).parent == Path(codex).parent
        for name in ("codex", "claude"):
            script = _readme_block(name).replace("http://127.0.0.1:8000", proxy.url)
            t0 = time.monotonic()
            r = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=work, env=env, capture_output=True,
                               text=True, timeout=300, stdin=subprocess.DEVNULL)  # fmt: skip
            out = r.stdout + r.stderr
            assert r.returncode == 0, out[-3000:]
            print(f"first try, {name}: both commands in {time.monotonic() - t0:.1f} s")
            assert r.stdout.count("Hello from Splice!") == 2, out[-3000:]  # each command printed the reply
        sessions = proxy.get("/v1/sessions").json()["data"]
        assert [s["turns"] for s in sessions] == [2, 2]
        for s in sessions:
            turns = _turns(proxy, s["session_id"])
            _all_spliced(turns)
            assert turns[1]["finish_reason"] == "stop"
    finally:
        proxy.stop()
        _stop_engine(proxy)


def _stop_engine(proxy) -> None:
    from tests.e2e.conftest import kill_tree

    kill_tree(proxy)
