"""EnginePool against real reference engines over loopback HTTP (real forward passes).

- A pause that lands mid-generation returns partial output; after a weight update and resume
  the finished Generation stamps the first tokens v0 and the rest v1, and the v0 tokens'
  proximal values equal a direct forward pass of the new weights.
- Failover: with one of two engines stopped, sessions it owned go to the survivor.
"""

from __future__ import annotations

import asyncio

import pytest

torch = pytest.importorskip("torch")
testing = pytest.importorskip("engines.reference.testing")
model_init = pytest.importorskip("engines.reference.model_init")

from engines.pool import EnginePool  # noqa: E402
from engines.types import SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow

# <|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n
PROMPT = [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]
LONG_REPLY = " ".join(f"word{i}" for i in range(30)) + "<|im_end|>"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    torch.set_num_threads(1)
    v0 = model_init.init_model(tmp_path_factory.mktemp("live-v0"), seed=0)
    v1 = model_init.perturb_model(v0, tmp_path_factory.mktemp("live-v1"), seed=1, scale=0.2)
    return v0, v1


def direct_logprobs(model_dir, ids: list[int]) -> list[float | None]:
    """log p(ids[i] | ids[:i]) from one plain transformers forward pass (entry 0 is None)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        lsm = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [None] + [float(lsm[i - 1, ids[i]]) for i in range(1, len(ids))]


def test_pause_mid_generation_then_update_and_resume(models):
    v0_dir, v1_dir = models
    url, stop = testing.start_engine_in_thread(v0_dir, script=[LONG_REPLY], script_delay_s=0.02, weight_version="0")

    async def go():
        streamed: list[int] = []

        async def on_tokens(ids, logprobs):
            streamed.extend(ids)

        pool = EnginePool("sglang", [url], health_interval_s=0)
        await pool.start()
        try:
            task = asyncio.create_task(
                pool.generate(PROMPT, SamplingParams(max_new_tokens=200), session_id="live", on_tokens=on_tokens)
            )
            deadline = asyncio.get_running_loop().time() + 20
            while len(streamed) < 3:
                assert asyncio.get_running_loop().time() < deadline and not task.done()
                await asyncio.sleep(0.005)
            await pool.pause()
            while pool.status()["held"] != 1:
                assert asyncio.get_running_loop().time() < deadline and not task.done()
                await asyncio.sleep(0.005)
            partial = len(streamed)
            await pool.update_weights(str(v1_dir), 1)
            await pool.resume()
            gen = await asyncio.wait_for(task, 30)
            return gen, partial, streamed
        finally:
            await pool.close()

    try:
        gen, partial, streamed = asyncio.run(go())
    finally:
        stop()

    n = len(gen.output_ids)
    assert 0 < partial < n, "the pause must land mid-generation"
    assert streamed == gen.output_ids
    assert gen.aborts == 1 and gen.segments == 2 and gen.finish_reason == "stop"
    assert gen.versions == [0] * partial + [1] * (n - partial)
    assert gen.proximal_versions == [1] * n
    # v0 tokens: their logprob under v1, exactly what a direct forward pass of v1 gives
    full = PROMPT + gen.output_ids
    truth_v1 = direct_logprobs(v1_dir, full)[len(PROMPT):]
    truth_v0 = direct_logprobs(v0_dir, full)[len(PROMPT):]
    assert gen.proximal_logprobs_t[:partial] == pytest.approx(truth_v1[:partial], abs=1e-4)
    assert gen.logprobs[:partial] == pytest.approx(truth_v0[:partial], abs=1e-4)
    assert max(abs(a - b) for a, b in zip(truth_v0[:partial], truth_v1[:partial])) > 1e-3  # the update changed them
    # v1 tokens: behaviour == proximal == the v1 forward pass
    assert gen.proximal_logprobs_t[partial:] == gen.logprobs[partial:]
    assert gen.logprobs[partial:] == pytest.approx(truth_v1[partial:], abs=1e-4)


def test_failover_to_the_surviving_engine(models):
    v0_dir, _ = models
    url_a, stop_a = testing.start_engine_in_thread(v0_dir, weight_version="0")
    url_b, stop_b = testing.start_engine_in_thread(v0_dir, weight_version="0")

    async def go():
        pool = EnginePool("sglang", [url_a, url_b], health_interval_s=0)
        await pool.start()
        try:
            owned_by_b = [s for s in (f"sess-{i}" for i in range(200)) if pool.replica_for(s) == url_b][:3]
            before = await pool.generate(PROMPT, SamplingParams(max_new_tokens=2), session_id=owned_by_b[0])
            stop_b()
            after = [await pool.generate(PROMPT, SamplingParams(max_new_tokens=2), session_id=s) for s in owned_by_b]
            routed = [pool.replica_for(s) for s in owned_by_b]
            return before, after, routed, await pool.health()
        finally:
            await pool.close()

    try:
        before, after, routed, health = asyncio.run(go())
    finally:
        stop_b()
        stop_a()
    assert before.replica == url_b
    assert [g.replica for g in after] == [url_a] * 3
    assert all(len(g.output_ids) == 2 for g in after)
    assert routed == [url_a] * 3
    assert health == {url_a: True, url_b: False}
