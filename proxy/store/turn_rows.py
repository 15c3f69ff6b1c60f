"""A stored turn's row: the one SELECT every reader uses, and decoding a row into arrays or a record."""

from __future__ import annotations

import numpy as np
import orjson

from .images import unpack_refs
from .packing import unpack_f32, unpack_i32, unpack_proximal, unpack_runs
from .records import TurnRecord
from .samples import TurnTokens

SELECT = (
    "SELECT t.seq, t.turn_id, t.session_id, t.idx, t.parent_turn_id, t.prompt_base, t.prompt_base_len, "
    "t.prompt_tail, t.n_output, t.output_ids, t.logprobs, t.versions, p.prox_logprobs, p.prox_versions, "
    "t.spliced, t.fork_reason, t.finish_reason, t.created_at, sm.json, t.drift, t.api, t.response_id, "
    "EXISTS (SELECT 1 FROM abandoned a WHERE a.turn_seq = t.seq), ti.refs, t.role "
    "FROM turns t LEFT JOIN proximal p ON p.turn_seq = t.seq JOIN samplings sm ON sm.id = t.sampling_id "
    "LEFT JOIN turn_images ti ON ti.turn_seq = t.seq "
)


def token_arrays(logprobs, versions, prox_lp, prox_v):
    """A stored turn's packed per-token columns as arrays: logprobs, versions, proximal both."""
    lp = unpack_f32(logprobs)
    v = unpack_runs(versions)
    return (lp, v, *unpack_proximal(lp, v, prox_lp, prox_v))


def row_tokens(row, prompt: np.ndarray) -> TurnTokens:
    (
        _seq, turn_id, _session_id, idx, _parent, _base, _base_len, _tail, _n_out,
        output_ids, logprobs, versions, prox_lp, prox_v, spliced, fork_reason, finish_reason,
        created_at, sampling, _drift, _api, _response_id, abandoned, image_refs, role,
    ) = row  # fmt: skip
    lp, v, plp, pv = token_arrays(logprobs, versions, prox_lp, prox_v)
    return TurnTokens(
        turn_id=turn_id, index=idx, prompt_ids=prompt, output_ids=unpack_i32(output_ids), output_logprobs=lp,
        versions=v, proximal_logprobs_t=plp, proximal_versions=pv, spliced=bool(spliced), fork_reason=fork_reason,
        finish_reason=finish_reason, created_at=created_at, requested_sampling=orjson.loads(sampling),
        abandoned=bool(abandoned), images=unpack_refs(image_refs), role=role,
    )  # fmt: skip


def row_record(row, prompt: np.ndarray) -> TurnRecord:
    """The record of a row (lists, for the API): its token columns decoded as ``row_tokens`` does."""
    t = row_tokens(row, prompt)
    session_id, parent, drift, api, response_id = row[2], row[4], row[19], row[20], row[21]
    return TurnRecord(
        turn_id=t.turn_id, session_id=session_id, index=t.index, parent_turn_id=parent, prompt_ids=prompt.tolist(),
        output_ids=t.output_ids.tolist(), output_logprobs=t.output_logprobs.tolist(), versions=t.versions.tolist(),
        proximal_logprobs_t=t.proximal_logprobs_t.tolist(), proximal_versions=t.proximal_versions.tolist(),
        spliced=t.spliced, fork_reason=t.fork_reason, finish_reason=t.finish_reason, created_at=t.created_at,
        requested_sampling=t.requested_sampling, drift=bool(drift), api=api, response_id=response_id,
        abandoned=t.abandoned, images=t.images, role=t.role,
    )  # fmt: skip
