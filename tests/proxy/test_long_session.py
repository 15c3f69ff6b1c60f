"""A 100k-token session end to end in one process: a turn whose tool result is ~100k tokens goes
through the real app (real Qwen3 tokenizer and template, an SGLang stand-in with the released
wire format), the store and an Arrow pull. The sample holds exactly what the engine was sent and
sampled; the store keeps <= 12.5 bytes per stored token; the pull's Python allocations stay a
small multiple of the sample's 21 bytes per token (no per-token Python objects)."""

from __future__ import annotations

import asyncio
import tracemalloc

import httpx
import numpy as np
import pyarrow as pa
import respx

from proxy.app import create_app
from proxy.settings import Settings
from tests.fakes.engines import FakeSGLang, Step
from tokenization import ChatFormat, load_tokenizer, qwen3_tokenizer_dir

TOK = load_tokenizer(str(qwen3_tokenizer_dir()))
URL = "http://engine-a:30000"
ARROW = "application/vnd.apache.arrow.stream"
TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]


def _steps(text: str, lp0: float) -> Step:
    ids = TOK.encode(text, add_special_tokens=False)
    return Step(tokens=[(t, lp0 - k / 1024) for k, t in enumerate(ids)])


def _long_tool_result(rng, n_words: int) -> str:
    words = ["alpha", "beta", "kernel", "def", "return", "{", "}", "0x1f", "tensor", "# note", "self.x", "==", "\n"]
    return " ".join(rng.choice(words, n_words).tolist()) + " " + " ".join(str(int(x)) for x in rng.integers(0, 10**6, n_words // 8))


def test_a_100k_token_session_through_turn_store_and_arrow_pull(tmp_path):
    rng = np.random.default_rng(0)
    tool_text = _long_tool_result(rng, 60_000)
    call = '<tool_call>\n{"name": "read_file", "arguments": {"path": "big.py"}}\n</tool_call><|im_end|>'
    answer = "The file defines a kernel and returns a tensor.<|im_end|>"

    async def main():
        with respx.mock(assert_all_called=False) as router:
            router.route(host="127.0.0.1").pass_through()
            engine = FakeSGLang(router, URL, context_length=262_144)
            engine.script = [_steps(call, -0.25), _steps(answer, -0.5)]
            app = create_app(Settings(store=str(tmp_path / "s.sqlite"), engine_url=[URL]), fmt=ChatFormat(TOK, "qwen3"),
                             pool=__import__("engines.pool", fromlist=["EnginePool"]).EnginePool("sglang", [URL], health_interval_s=0))  # fmt: skip
            async with app.router.lifespan_context(app):
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as c:
                    msgs = [{"role": "user", "content": "Summarize big.py."}]
                    hdr = {"X-Session-Id": "long"}
                    r1 = await c.post("/v1/chat/completions", json={"messages": msgs, "tools": TOOLS}, headers=hdr)
                    m = r1.json()["choices"][0]["message"]
                    msgs += [{"role": "assistant", "content": m.get("content"), "tool_calls": m["tool_calls"]},
                             {"role": "tool", "tool_call_id": m["tool_calls"][0]["id"], "content": tool_text}]  # fmt: skip
                    r2 = await c.post("/v1/chat/completions", json={"messages": msgs, "tools": TOOLS}, headers=hdr)
                    assert r2.status_code == 200, r2.text
                    assert (await c.post("/v1/sessions/long/reward", json={"reward": 1.0})).status_code == 200
                    stats = app.state.store.stats()
                    pa.array([0])  # pyarrow's one-time lazy imports (pandas, when installed) are not per pull
                    tracemalloc.start()
                    pulled = await c.post("/v1/trajectories/pull", json={"max_samples": 4}, headers={"Accept": ARROW})
                    _, peak = tracemalloc.get_traced_memory()
                    tracemalloc.stop()
            return engine, r1, pulled, stats, peak

    engine, r1, pulled, stats, peak = asyncio.run(main())
    assert pulled.status_code == 200 and pulled.headers["content-type"] == ARROW
    (sample,) = pa.ipc.open_stream(pulled.content).read_all().to_pylist()
    sent1, sent2 = (req["input_ids"] for req in engine.requests)
    out1 = [t for t, _ in _steps(call, -0.25).tokens]
    out2 = [t for t, _ in _steps(answer, -0.5).tokens]
    n = len(sent2) + len(out2)
    assert n > 100_000, n  # a 100k-token session
    assert sent2[: len(sent1) + len(out1)] == sent1 + out1  # the second prompt was spliced, not re-rendered
    assert sample["input_ids"] == sent2 + out2
    mask = np.zeros(n, np.uint8)
    mask[len(sent1) : len(sent1) + len(out1)] = 1
    mask[len(sent2) :] = 1
    assert sample["loss_mask"] == mask.tolist()
    lp = np.asarray(sample["logprobs"], np.float32)
    assert lp[len(sent2) :].tolist() == [np.float32(-0.5 - k / 1024) for k in range(len(out2))]
    assert [t["start"] for t in sample["turns"]] == [len(sent1), len(sent2)]

    stored_tokens = stats["prompt_tokens"] + stats["tokens"] - len(sent1)  # turn 2's prompt repeats turn 1's
    per_token = stats["db_bytes"] / n
    assert per_token <= 12.5, (stats, per_token, stored_tokens)
    assert len(pulled.content) / n <= 14.0  # bytes per token on the wire
    assert peak / n <= 64, peak / n  # Python allocations while pulling, per token of the sample
