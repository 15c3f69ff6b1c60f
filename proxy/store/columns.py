"""Samples as Apache Arrow columns: the binary pull (IPC stream) and the Parquet export.

One row per sample, the same column names as the JSON sample (``proxy/schemas/sample.schema.json``):
per-token arrays are ``list<int32>`` (ids, versions), ``list<float32>`` (logprobs) and
``list<uint8>`` (mask), built straight from the NumPy arrays of assembly (no per-token Python
objects). Response-level fields (lease id, schema version, ``dropped_stale``) travel in the
schema's metadata under ``splice.*`` keys, so a saved stream still says what it is.
Buffers are LZ4-compressed by default (a standard IPC option every Arrow reader decodes):
versions are long runs and context tokens carry zeros, which is how a sample stays well under
the 21 bytes per token of its raw arrays. LZ4 rather than zstd: zstd saves another ~1.5 bytes
per token but takes twice as long to decode (``splice bench pull``, docs/samples.md).
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Iterator
from dataclasses import asdict

import numpy as np
import pyarrow as pa

from .samples import SAMPLE_SCHEMA_VERSION, TOKEN_ARRAYS, Sample

ARROW_STREAM = "application/vnd.apache.arrow.stream"
CHUNK_TOKENS = 1 << 18  # samples are written in record batches of about this many tokens (one sample at least)

TURN = pa.struct(
    [
        ("turn_id", pa.string()),
        ("index", pa.int32()),
        ("context_start", pa.int32()),
        ("start", pa.int32()),
        ("length", pa.int32()),
        ("finish_reason", pa.string()),
        ("fork_reason", pa.string()),
        ("spliced", pa.bool_()),
        ("created_at", pa.float64()),
        ("model", pa.string()),
        ("engine_id", pa.string()),
        ("temperature", pa.float64()),
        ("top_p", pa.float64()),
        ("top_k", pa.int32()),
        ("role", pa.string()),
    ]
)

IMAGE = pa.struct(
    [
        ("hash", pa.string()),
        ("offset", pa.int32()),
        ("length", pa.int32()),
        ("grid_thw", pa.list_(pa.int32())),
    ]
)

_ARROW_TYPES = {np.dtype("<i4"): pa.int32(), np.dtype("<f4"): pa.float32(), np.dtype("u1"): pa.uint8()}

SCHEMA = pa.schema(
    [
        ("schema_version", pa.int32()),
        ("sample_id", pa.string()),
        ("session_id", pa.string()),
        ("group_id", pa.string()),
        ("role", pa.string()),
        ("reward", pa.float64()),
        ("rewarded_at", pa.float64()),
        ("trainable", pa.bool_()),
        ("n_tokens", pa.int32()),
        ("turn_ids", pa.list_(pa.string())),
        ("turns", pa.list_(TURN)),
        ("images", pa.list_(IMAGE)),
    ]
    + [(name, pa.list_(_ARROW_TYPES[dtype])) for name, dtype in TOKEN_ARRAYS.items()]
)


def schema(**metadata: object) -> pa.Schema:
    """The Arrow schema with ``splice.schema_version`` and ``splice.<key>`` metadata (None dropped)."""
    meta = {"splice.schema_version": str(SAMPLE_SCHEMA_VERSION)}
    meta.update({f"splice.{k}": str(v) for k, v in metadata.items() if v is not None})
    return SCHEMA.with_metadata(meta)


def _list_column(arrays: list[np.ndarray], value_type: pa.DataType) -> pa.ListArray:
    sizes = np.fromiter((a.size for a in arrays), dtype=np.int64, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum(sizes, out=offsets[1:])
    values = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, value_type))


def record_batch(samples: list[Sample]) -> pa.RecordBatch:
    """One row per sample."""
    heads = [s.header() for s in samples]
    columns = []
    for f in SCHEMA:
        if f.name in TOKEN_ARRAYS:
            columns.append(_list_column([getattr(s, f.name) for s in samples], f.type.value_type))
        elif f.name == "turns":
            columns.append(pa.array([[asdict(t) for t in s.turns] for s in samples], f.type))
        else:
            columns.append(pa.array([h[f.name] for h in heads], f.type))
    return pa.RecordBatch.from_arrays(columns, schema=SCHEMA)


def chunks(samples: Iterable[Sample], chunk_tokens: int = CHUNK_TOKENS) -> Iterator[pa.RecordBatch]:
    """Record batches of whole samples, each about ``chunk_tokens`` tokens (one sample at least)."""
    pending: list[Sample] = []
    tokens = 0
    for s in samples:
        if pending and tokens + len(s) > chunk_tokens:
            yield record_batch(pending)
            pending, tokens = [], 0
        pending.append(s)
        tokens += len(s)
    if pending:
        yield record_batch(pending)


def ipc_stream(samples: Iterable[Sample], *, compression: str | None = "lz4", chunk_tokens: int = CHUNK_TOKENS,
               **metadata: object) -> Iterator[bytes]:
    """The Arrow IPC stream of ``samples``, as byte chunks to send as they are made (the schema
    first, then one piece per record batch, then the end-of-stream marker)."""
    buf = io.BytesIO()

    def drain() -> bytes:
        out = buf.getvalue()
        buf.seek(0)
        buf.truncate()
        return out

    # one thread: the buffers of a chunk are small, and the pull must not take every core from turns
    options = pa.ipc.IpcWriteOptions(compression=compression, use_threads=False)
    with pa.ipc.new_stream(buf, schema(**metadata), options=options) as writer:
        yield drain()
        for batch in chunks(samples, chunk_tokens):
            writer.write_batch(batch)
            yield drain()
    yield drain()
