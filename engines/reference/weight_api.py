"""SGLang's weight-update routes over ``torch.distributed`` (released 0.5.23 request shapes).

- ``POST /init_weights_update_group`` ``{"master_address", "master_port", "rank_offset",
  "world_size", "group_name": "weight_update_group", "backend": "nccl"}``: join the group
  (blocks until every rank arrived) -> ``{"success", "message"}``, 400 on failure.
- ``POST /update_weights_from_distributed`` ``{"names", "dtypes", "shapes", "group_name",
  "flush_cache": true, "abort_all_requests": false, "weight_version": null, "load_format": null}``:
  receive one broadcast per tensor, then copy them into the model between decode steps (all of
  this call's tensors or none) and stamp ``weight_version`` when given -> ``{"success",
  "message"}``, 400 on failure.
- ``POST /destroy_weights_update_group`` ``{"group_name"}`` -> ``{"success", "message"}``.
- ``GET|POST /get_weights_by_name`` ``{"name", "truncate_size": 100}``: the parameter as float32
  nested lists, first ``truncate_size`` rows (SGLang's ``tolist()[:truncate_size]``).

The CPU engine joins with ``gloo`` (``nccl`` needs the model on a GPU, a 400 here). Receiving
runs off the event loop and off the worker thread; only the copy into the model is serialised
with generation, as a disk load is.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from fastapi import APIRouter, Request

from .state import BadRequest, EngineState, error_response, json_response, read_json, wait_disconnect
from .weight_sync import JoinCancelled, WeightGroups, parse_update

log = logging.getLogger(__name__)

DEFAULT_GROUP = "weight_update_group"


def _fail(message: str, status: int = 400):
    return json_response({"success": False, "message": message}, status)


def make_router(state: EngineState, groups: WeightGroups) -> APIRouter:
    r = APIRouter()

    @r.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request):
        try:
            body = await read_json(request)
        except BadRequest as e:
            return _fail(str(e))
        missing = [k for k in ("master_address", "master_port", "rank_offset", "world_size") if body.get(k) is None]
        if missing:
            return error_response(f"missing field(s) {missing}", 422)
        cancelled = threading.Event()  # the caller hung up: stop trying to reach the trainer
        gone = asyncio.create_task(wait_disconnect(request))
        gone.add_done_callback(lambda t: t.cancelled() or (t.exception(), cancelled.set()))  # a failed receive: gone too
        try:
            await asyncio.to_thread(
                groups.join,
                master_address=str(body["master_address"]),
                master_port=int(body["master_port"]),
                rank_offset=int(body["rank_offset"]),
                world_size=int(body["world_size"]),
                group_name=str(body.get("group_name") or DEFAULT_GROUP),
                backend=str(body.get("backend") or "nccl"),
                cancelled=cancelled,
            )
        except JoinCancelled as e:
            log.info("%s", e)
            return _fail(f"Failed to initialize custom process group: {e}.")
        except (ValueError, TypeError) as e:
            return _fail(f"Failed to initialize custom process group: {e}.")
        except Exception as e:  # noqa: BLE001 - rendezvous timeout, unreachable master, ...
            log.warning("joining weight-update group failed: %r", e)
            return _fail(f"Failed to initialize custom process group: {e}.")
        finally:
            gone.cancel()
        return json_response({"success": True, "message": "Succeeded to initialize custom process group."})

    @r.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        try:
            body = await read_json(request)
            names, dtypes, shapes = parse_update(body)
        except (BadRequest, ValueError) as e:
            return _fail(str(e))
        if body.get("load_format") not in (None, "auto"):
            return _fail(f"load_format {body['load_format']!r} is not supported by the reference engine")
        group = str(body.get("group_name") or DEFAULT_GROUP)
        if group not in groups.names():
            return _fail(f"Group {group} not in {groups.names()}. Please call `init_weights_update_group` first.")
        try:
            tensors = await asyncio.to_thread(groups.receive, group, names, dtypes, shapes)
        except Exception as e:  # noqa: BLE001 - the sender went away or timed out: the group is unusable
            groups.destroy(group)
            log.warning("receiving weights over %s failed: %r", group, e)
            return _fail(f"Failed to receive weights over group {group}: {e}; the group was destroyed")
        version = body.get("weight_version")
        fut = state.worker.load_tensors(tensors, None if version is None else str(version), abort_all=bool(body.get("abort_all_requests")))
        ok, message = await asyncio.wrap_future(fut)
        if ok:
            message = "Succeeded to update parameter online."
            if version is not None:
                message += f" Weight version updated to {version}."
        return json_response({"success": ok, "message": message}, 200 if ok else 400)

    @r.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request):
        try:
            body = await read_json(request)
        except BadRequest as e:
            return _fail(str(e))
        if groups.destroy(str(body.get("group_name") or DEFAULT_GROUP)):
            return json_response({"success": True, "message": "Succeeded to destroy custom process group."})
        return _fail("The group to be destroyed does not exist.")

    @r.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(request: Request):
        try:
            body = await read_json(request)
        except BadRequest as e:
            return error_response(str(e))
        name = body.get("name")
        size = body.get("truncate_size", 100)
        if not isinstance(name, str) or isinstance(size, bool) or not isinstance(size, int):
            return error_response("name (a string) is required; truncate_size must be an integer", 422)

        def read():
            t = state.lm.weight(name)
            if t is None:
                return None
            return t.detach().cpu().float().tolist() if t.dim() == 0 else t[: max(size, 0)].detach().cpu().float().tolist()

        values = await asyncio.wrap_future(state.worker.call(read))
        if values is None:
            return error_response("Get parameter by name failed")
        return json_response(values)

    return r
