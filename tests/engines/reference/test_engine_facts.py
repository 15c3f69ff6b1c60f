"""The reference engine reports its facts the way SGLang and vLLM do, and its vLLM dialect has
vLLM's dev-mode weight endpoints, so ``EnginePool`` runs the same code in either dialect."""

from __future__ import annotations

import asyncio

import httpx

from engines.pool import EnginePool
from engines.reference.lm import LanguageModel


def _context_len(model_dir) -> int:
    import json
    from pathlib import Path

    return int(json.loads((Path(model_dir) / "config.json").read_text())["max_position_embeddings"])


def test_both_dialects_report_context_model_and_controls(engine, model_dir):
    async def go():
        out = {}
        for kind in ("sglang", "vllm"):
            pool = EnginePool(kind, [engine], health_interval_s=0)
            await pool.start()
            out[kind] = pool.info
            await pool.close()
        return out

    infos = asyncio.run(go())
    ctx = _context_len(model_dir)
    for kind, info in infos.items():
        assert info.context_length == ctx, kind
        assert info.served_model == "tiny" and info.model_path == str(model_dir), kind
        assert info.weight_version == 0 and info.can_pause and info.can_reload, kind
        assert info.warnings == () or kind == "vllm", (kind, info.warnings)
    assert infos["vllm"].tied_lm_head is True  # init_model ties the head; read from config.json
    models = httpx.get(engine + "/v1/models").json()["data"][0]
    assert models["max_model_len"] == ctx and models["root"] == str(model_dir)


def test_vllm_dialect_weight_cycle_on_the_reference_engine(model_dir, perturbed_dir, oracle_v1):
    """pause -> collective_rpc reload_weights -> update_weight_version -> resume; then prefill
    values equal a direct forward pass of the new weights."""
    from engines.reference.testing import start_engine_in_thread

    url, stop = start_engine_in_thread(model_dir, weight_version="0", served_model_name="tiny")
    prompt = [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]

    async def go():
        pool = EnginePool("vllm", [url], health_interval_s=0)
        await pool.start()
        try:
            await pool.pause()
            await pool.update_weights(str(perturbed_dir), 1)
            await pool.resume()
            values = await pool.prefill_logprobs(prompt, 1, session_id="s")
            info = await pool.refresh_info()
            bad = None
            try:
                await pool.update_weights("/does/not/exist", 2)
            except Exception as exc:  # noqa: BLE001
                bad = exc
            return values, info, pool.version, bad
        finally:
            await pool.close()

    try:
        values, info, version, bad = asyncio.run(go())
        assert httpx.get(url + "/weight_info").json() == {"weight_version": "1"}
    finally:
        stop()
    expected = oracle_v1.logprobs(prompt)[1:]
    assert max(abs(a - b) for a, b in zip(values, expected)) < 1e-4
    assert version == 1 and info.weight_version == 1
    assert bad is not None and "collective_rpc" in str(bad)


def test_lm_context_len_comes_from_the_config(model_dir):
    assert LanguageModel(model_dir).context_len == _context_len(model_dir)
