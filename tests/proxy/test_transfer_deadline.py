"""A weight transfer over torch.distributed that nobody finishes does not hold an engine in
limbo unannounced: after ``transfer_deadline_s`` with no join, bucket or commit, an engine whose
current weights are on disk is reloaded from that path and serves again; otherwise it stays out
of rotation with a status that says the transfer was abandoned. And a commit naming no engine of
this proxy or of the transfer begun here is refused without moving the version.

SGLang stand-ins on respx (``/update_weights_from_distributed`` answers SGLang's
``{"success": false, "message"}`` with 400 when it refuses a bucket)."""

from __future__ import annotations

import asyncio
import logging
import time

import httpx
import pytest
import respx

from engines.pool import EnginePool, engine_id
from engines.types import EngineUnavailable, SamplingParams
from engines.weight_transfer import TensorBatch
from tests.fakes.engines import FakeSGLang, Step

A = "http://engine-a:30000"
DEADLINE = 30.0


def _pool() -> EnginePool:
    return EnginePool("sglang", [A], health_interval_s=0, transfer_deadline_s=DEADLINE)


def _bucket(version: int) -> TensorBatch:
    return TensorBatch(("lm_head.weight",), ("float32",), ((4, 4),), "g1", version, first=True, final=False)


async def _generate(pool: EnginePool):
    return await pool.generate([1, 2, 3], SamplingParams(max_new_tokens=2), session_id="s")


def test_begin_never_followed_stays_out_with_an_abandoned_status(caplog):
    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeSGLang(router, A, version="3")
            fake.script = [Step(tokens=[(5, -0.1), (6, -0.2)])] * 4
            pool = _pool()
            await pool.start()
            assert pool.begin_transfer([A], 4) == [engine_id(A)]
            assert pool.expire_transfers(now=time.monotonic() + DEADLINE - 1) == []  # not yet
            with pytest.raises(EngineUnavailable):
                await _generate(pool)
            with caplog.at_level(logging.WARNING, logger="engines.pool"):
                assert pool.expire_transfers(now=time.monotonic() + DEADLINE + 1) == [engine_id(A)]
            assert pool.expire_transfers(now=time.monotonic() + 10 * DEADLINE) == []  # once
            status = pool.status()
            why = status["out_of_rotation"][engine_id(A)]
            assert "abandoned" in why and "publish" in why and status["expired_transfers"] == 1
            assert any("abandoned" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
            with pytest.raises(EngineUnavailable):  # no disk copy of v3 known: it stays out
                await _generate(pool)
            # a complete publish brings it back, as before
            await pool.update_weights("/ckpt/v4", 4)
            assert pool.status()["out_of_rotation"] == {}
            assert (await _generate(pool)).output_ids == [5, 6]
            await pool.close()

    asyncio.run(go())


def test_a_refused_bucket_with_the_weights_on_disk_is_reloaded_and_serves_again():
    async def go():
        with respx.mock(assert_all_called=False) as router:
            fake = FakeSGLang(router, A, version="0")
            fake.script = [Step(tokens=[(7, -0.1), (8, -0.2)])] * 4
            router.post(f"{A}/update_weights_from_distributed").mock(
                return_value=httpx.Response(400, json={"success": False, "message": "shape mismatch for lm_head.weight"})
            )
            pool = _pool()
            await pool.start()
            await pool.update_weights("/ckpt/v1", 1)  # v1's weights are on disk
            pool.begin_transfer([A], 2)
            with pytest.raises(Exception, match="shape mismatch"):
                await pool.update_weights_from_distributed(A, _bucket(2))
            assert "stopped half way" in pool.status()["out_of_rotation"][engine_id(A)]
            assert pool.expire_transfers(now=time.monotonic() + DEADLINE + 1) == [engine_id(A)]
            replica = pool.status()["engine_replicas"][0]
            assert replica["out_of_rotation"] is None and replica["stale"]  # not routed to until reloaded
            loads = [b for p, b in fake.admin if p == "/update_weights_from_disk"]
            pool.health_interval_s = 0.01  # one round of the health check: it reloads v1 from disk
            pool._health_task = asyncio.create_task(pool._health_loop())
            deadline = time.monotonic() + 10
            while pool.status()["engine_replicas"][0]["stale"] and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert not pool.status()["engine_replicas"][0]["stale"]
            again = [b for p, b in fake.admin if p == "/update_weights_from_disk"][len(loads):]
            assert [b["model_path"] for b in again] == ["/ckpt/v1"]  # its whole v1 weights, from disk
            assert (await _generate(pool)).output_ids == [7, 8]
            await pool.close()

    asyncio.run(go())


def test_a_commit_naming_no_known_engine_moves_nothing():
    async def go():
        with respx.mock(assert_all_called=False) as router:
            FakeSGLang(router, A, version="0")
            pool = _pool()
            await pool.start()
            with pytest.raises(ValueError, match="names no engine"):
                pool.commit_transfer(7, ["http://nowhere:1"], {})
            assert pool.version == 0
            # an engine of the fleet named by this version's begin counts (another proxy's engine)
            pool.begin_transfer([A, "http://engine-b:30000"], 7)
            with pytest.raises(ValueError):  # a begin of another version does not vouch for it
                pool.commit_transfer(8, ["http://engine-b:30000"], {})
            out = pool.commit_transfer(7, ["http://engine-b:30000", "http://nowhere:1"], {A: "join failed"})
            assert pool.version == 7 and out["ignored"] == ["http://nowhere:1"]
            assert "did not complete: join failed" in pool.status()["out_of_rotation"][engine_id(A)]
            await pool.close()

    asyncio.run(go())
