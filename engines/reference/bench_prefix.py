"""Second-turn latency of a Claude-Code-sized episode on the reference engine, without and with
prefix reuse: ``python -m engines.reference.bench_prefix [--model DIR] [--tokens 21000]``.

Turn 1 is a ~21k-token prompt shaped like Claude Code's first request (a long system prompt
and tool list, one user message), rendered with the model's chat template; the engine, in
script mode, answers with a Bash tool call. Turn 2 is what Splice sends next: turn 1's prompt
+ its output + the tool result's bridge (a spliced prompt). Each configuration runs in a fresh
engine subprocess (``--prefix-cache-mb 0`` for "off"), over SGLang's ``/generate``. Prints a
table; the numbers depend on the CPU.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import httpx

from .launch import REPO_ROOT, start_engine

SCRIPT = [
    '<tool_call>\n{"name": "Bash", "arguments": {"command": "ls", "description": "List files"}}\n</tool_call><|im_end|>',
    "The directory holds README.md and docs.<|im_end|>",
]
TOOLS = ["Bash", "Read", "Edit", "Write", "Glob", "Grep", "WebFetch", "TodoWrite", "Task"]


def claude_like_prompt(tokenizer, tokens: int) -> list[int]:
    """A first prompt of about ``tokens`` tokens: system text (this repository's docs, repeated
    as needed) and nine tool definitions, then one user message."""
    docs = "\n\n".join(p.read_text() for p in sorted((REPO_ROOT / "docs").glob("*.md"))) or " ".join(f"Rule {i}: keep the change small." for i in range(20000))
    tools = [{"type": "function", "function": {
        "name": name, "description": f"{name}: " + docs[i * 2000 : i * 2000 + 1500],
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}, "description": {"type": "string"}},
                       "required": ["command"]}}} for i, name in enumerate(TOOLS)]  # fmt: skip
    system = ""
    while True:
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": "List the files here."}]
        text = tokenizer.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        if len(ids) >= tokens:
            return ids
        need = tokens - len(ids)
        system += docs[: need * 4]  # ~4 characters per token of English / Markdown (overshoots a little)


def bridge(tokenizer) -> list[int]:
    """What a spliced second turn adds after the first turn's output (which ends with ``<|im_end|>``)."""
    text = "\n<|im_start|>user\n<tool_response>\nREADME.md\ndocs\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _generate(url: str, ids: list[int]) -> tuple[dict, float]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 64, "temperature": 1.0}, "return_logprob": True}
    t0 = time.perf_counter()
    r = httpx.post(url + "/generate", json=body, timeout=1800)
    r.raise_for_status()
    return r.json(), time.perf_counter() - t0


def run(model_dir: str, tokens: int, cache_mb: float, threads: int) -> dict:
    from .lm import load_tokenizer

    tok = load_tokenizer(model_dir)
    first = claude_like_prompt(tok, tokens)
    url, stop = start_engine(model_dir, script=SCRIPT, threads=threads, timeout_s=300,
                             extra_args=["--prefix-cache-mb", str(cache_mb)])  # fmt: skip
    try:
        r1, s1 = _generate(url, first)
        second = first + r1["output_ids"] + bridge(tok)
        r2, s2 = _generate(url, second)
    finally:
        stop()
    return {"prefix cache": "off" if cache_mb <= 0 else f"{cache_mb:g} MB", "turn 1 prompt": len(first),
            "turn 1 s": s1, "turn 2 prompt": len(second), "turn 2 cached": r2["meta_info"]["cached_tokens"],
            "turn 2 s": s2, "turn 2 output": len(r2["output_ids"])}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engines.reference.bench_prefix", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="model dir (default: the bundled tiny model)")
    p.add_argument("--tokens", type=int, default=21000, help="size of the first prompt")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads of the engine (splice serve uses 1)")
    p.add_argument("--json", help="also write the rows to this file")
    a = p.parse_args(argv)
    if a.model is None:
        from .model_init import ensure_model

        a.model = str(ensure_model())
    rows = [run(a.model, a.tokens, mb, a.threads) for mb in (0, 1024)]
    cols = list(rows[0])
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(f"{r[c]:.2f}" if isinstance(r[c], float) else f"{r[c]:,}" if isinstance(r[c], int) else str(r[c]) for c in cols))
    if rows[0]["turn 2 s"] > 0:
        print(f"second turn: {rows[0]['turn 2 s'] / rows[1]['turn 2 s']:.1f}x faster with prefix reuse")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
