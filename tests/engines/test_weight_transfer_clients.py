"""Exact wire formats of the weight-transfer calls (docs/engines.md, "Weights over
torch.distributed"), against replies shaped like the released servers'.

The request models are those of the released sources (``pip download --no-deps``):
SGLang 0.5.23 ``sglang/srt/managers/io_struct.py`` (``InitWeightsUpdateGroupReqInput``,
``UpdateWeightsFromDistributedReqInput``, ``DestroyWeightsUpdateGroupReqInput``,
``GetWeightsByNameReqInput``) and its routes in ``sglang/srt/entrypoints/http_server.py``;
vLLM 0.32 ``vllm/entrypoints/rl/online/api_router.py`` (``Body(embed=True)`` for
``init_info``, ``update_info``, ``weight_version``) with ``NCCLWeightTransferInitInfo``
(``nccl_common.py``) and ``NCCLWeightTransferUpdateInfo`` (``nccl_engine.py``). vLLM's weight
transfer backends are NCCL only (``nccl``, ``ipc``, ``sparse_nccl``, ...), so no vLLM server
runs this path on this CPU machine; the SGLang shapes also run for real against the reference
engine (tests/e2e/test_weight_transfer.py).
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import respx

from engines.http_transport import EngineTransport
from engines.sglang import SGLangClient
from engines.types import EngineRejected, EngineUnsupported
from engines.vllm import VLLMClient
from engines.weight_transfer import TensorBatch, WeightGroup

SG = "http://sglang-a:30000"
VL = "http://vllm-a:8000"

# field names of the released request models (defaults in comments)
SGLANG_INIT_FIELDS = {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"}
SGLANG_UPDATE_FIELDS = {
    "names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests", "weight_version",
    "load_format", "selector", "torch_empty_cache",
}  # fmt: skip
VLLM_INIT_INFO_FIELDS = {"master_address", "master_port", "rank_offset", "world_size", "nccl_unique_id_b64", "packed", "packed_buffer_size_bytes", "packed_num_buffers"}
VLLM_UPDATE_INFO_FIELDS = {"names", "dtype_names", "shapes"}

GROUP = WeightGroup("10.0.0.5", 29555, "splice-weights-abc", "nccl")
B1 = TensorBatch(("model.embed_tokens.weight", "model.norm.weight"), ("bfloat16", "bfloat16"), ((151936, 4096), (4096,)), "splice-weights-abc", 7, first=True, final=False)
B2 = TensorBatch(("lm_head.weight",), ("bfloat16",), ((151936, 4096),), "splice-weights-abc", 7, first=False, final=True)


def run(coro):
    return asyncio.run(coro)


def _bodies(route) -> list:
    return [json.loads(c.request.content) if c.request.content else None for c in route.calls]


def test_sglang_calls_send_the_released_request_models():
    ok = {"success": True, "message": "Succeeded to initialize custom process group."}

    async def go():
        with respx.mock(assert_all_called=True) as r:
            init = r.post(f"{SG}/init_weights_update_group").mock(return_value=httpx.Response(200, json=ok))
            upd = r.post(f"{SG}/update_weights_from_distributed").mock(return_value=httpx.Response(200, json={"success": True, "message": "Succeeded to update parameter online."}))
            destroy = r.post(f"{SG}/destroy_weights_update_group").mock(return_value=httpx.Response(200, json={"success": True, "message": "Succeeded to destroy custom process group."}))
            weights = r.post(f"{SG}/get_weights_by_name").mock(return_value=httpx.Response(200, json=[[0.5, -0.25], [1.0, 2.0]]))
            async with httpx.AsyncClient(transport=EngineTransport()) as http:
                c = SGLangClient(http, SG)
                await c.init_weights_group(GROUP)
                await c.update_weights_from_distributed(B1)
                await c.update_weights_from_distributed(B2)
                await c.destroy_weights_group("splice-weights-abc")
                rows = await c.weights_by_name("model.norm.weight", truncate_size=2)
        return _bodies(init), _bodies(upd), _bodies(destroy), _bodies(weights), rows

    init, upd, destroy, weights, rows = run(go())
    assert init == [{"master_address": "10.0.0.5", "master_port": 29555, "rank_offset": 1, "world_size": 2, "group_name": "splice-weights-abc", "backend": "nccl"}]
    assert set(init[0]) <= SGLANG_INIT_FIELDS
    assert upd[0] == {
        "names": ["model.embed_tokens.weight", "model.norm.weight"], "dtypes": ["bfloat16", "bfloat16"],
        "shapes": [[151936, 4096], [4096]], "group_name": "splice-weights-abc", "flush_cache": False, "weight_version": None,
    }  # fmt: skip
    # the version is stamped with the last bucket only: a transfer cut short keeps the old one
    assert upd[1]["weight_version"] == "7" and upd[1]["flush_cache"] is True and upd[1]["names"] == ["lm_head.weight"]
    assert all(set(b) <= SGLANG_UPDATE_FIELDS for b in upd)
    assert destroy == [{"group_name": "splice-weights-abc"}]
    assert weights == [{"name": "model.norm.weight", "truncate_size": 2}] and rows == [[0.5, -0.25], [1.0, 2.0]]


@pytest.mark.parametrize("status", [200, 400])
def test_sglang_failure_reply_is_an_error_naming_the_engine(status):
    # SGLang answers 400 with {"success": false, "message"} on failure
    async def go():
        with respx.mock() as r:
            r.post(f"{SG}/update_weights_from_distributed").mock(
                return_value=httpx.Response(status, json={"success": False, "message": "Failed to update parameter online: boom"})
            )
            async with httpx.AsyncClient(transport=EngineTransport()) as http:
                await SGLangClient(http, SG).update_weights_from_distributed(B2)

    with pytest.raises(EngineRejected) as err:
        run(go())
    assert SG in str(err.value) and "boom" in str(err.value)


def test_vllm_weight_transfer_api_bodies():
    async def go():
        with respx.mock(assert_all_called=True) as r:
            init = r.post(f"{VL}/init_weight_transfer_engine").mock(return_value=httpx.Response(200, json={"message": "Weight transfer initialized"}))
            start = r.post(f"{VL}/start_weight_update").mock(return_value=httpx.Response(200, json={"message": "Weight update started"}))
            upd = r.post(f"{VL}/update_weights").mock(return_value=httpx.Response(200, json={"message": "Weights updated"}))
            fin = r.post(f"{VL}/finish_weight_update").mock(return_value=httpx.Response(200, json={"message": "Weight update finished"}))
            shut = r.post(f"{VL}/shutdown_weight_transfer_engine").mock(return_value=httpx.Response(200, json={"message": "Weight transfer shut down"}))
            async with httpx.AsyncClient(transport=EngineTransport()) as http:
                c = VLLMClient(http, VL, model="m")
                await c.init_weights_group(GROUP)
                await c.update_weights_from_distributed(B1)
                await c.update_weights_from_distributed(B2)
                await c.destroy_weights_group("splice-weights-abc")
        return [_bodies(x) for x in (init, start, upd, fin, shut)]

    init, start, upd, fin, shut = run(go())
    assert init == [{"init_info": {"master_address": "10.0.0.5", "master_port": 29555, "rank_offset": 1, "world_size": 2, "packed": False}}]
    assert set(init[0]["init_info"]) <= VLLM_INIT_INFO_FIELDS
    assert len(start) == 1  # opened once, before the first bucket
    assert upd == [
        {"update_info": {"names": ["model.embed_tokens.weight", "model.norm.weight"], "dtype_names": ["bfloat16", "bfloat16"], "shapes": [[151936, 4096], [4096]]}},
        {"update_info": {"names": ["lm_head.weight"], "dtype_names": ["bfloat16"], "shapes": [[151936, 4096]]}},
    ]
    assert all(set(b["update_info"]) == VLLM_UPDATE_INFO_FIELDS for b in upd)
    assert fin == [{"weight_version": "7"}]  # closed once, after the last, with the version
    assert len(shut) == 1


def test_vllm_without_dev_mode_or_over_gloo_is_unsupported():
    async def go(group):
        with respx.mock() as r:
            r.post(f"{VL}/init_weight_transfer_engine").mock(return_value=httpx.Response(404, json={"detail": "Not Found"}))
            async with httpx.AsyncClient(transport=EngineTransport()) as http:
                await VLLMClient(http, VL, model="m").init_weights_group(group)

    with pytest.raises(EngineUnsupported, match="does not exist"):
        run(go(GROUP))
    with pytest.raises(EngineUnsupported, match="NCCL only"):
        run(go(WeightGroup("127.0.0.1", 1234, "g", "gloo")))


def test_ranks_an_engine_joins_with():
    # SGLang: /server_info carries the server arguments (tp_size); vLLM: GET /get_world_size
    async def go():
        with respx.mock() as r:
            r.get(f"{SG}/server_info").mock(return_value=httpx.Response(200, json={"tp_size": 4, "dp_size": 1, "context_length": 4096}))
            ws = r.get(f"{VL}/get_world_size").mock(return_value=httpx.Response(200, json={"world_size": 2}))
            async with httpx.AsyncClient(transport=EngineTransport()) as http:
                sg = await SGLangClient(http, SG).weight_ranks()
                vl = await VLLMClient(http, VL, model="m").weight_ranks()
            return sg, vl, ws.calls[0].request.url.params.get("include_dp")

    assert run(go()) == (4, 2, "true")
