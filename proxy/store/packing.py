"""Packed token arrays: int32 ids and versions, float32 logprobs, run-length versions,
proximal values stored only where they differ from the behaviour logprobs."""

from __future__ import annotations

import numpy as np

I32 = np.dtype("<i4")
F32 = np.dtype("<f4")


def pack_i32(values) -> bytes:
    """int32 little-endian; raises OverflowError for values outside int32."""
    if not fits_i32(values):
        raise OverflowError("token id or version outside int32")
    return np.asarray(values, dtype=np.int64).astype(I32).tobytes()


def fits_i32(values) -> bool:
    if isinstance(values, list) and len(values) <= 2:
        return all(-(2**31) <= int(v) < 2**31 for v in values)
    a = np.asarray(values, dtype=np.int64)
    return a.size == 0 or (int(a.min()) >= -(2**31) and int(a.max()) < 2**31)


def unpack_i32(blob: bytes | None) -> np.ndarray:
    return np.frombuffer(blob or b"", dtype=I32)


def pack_f32(values) -> bytes:
    return np.asarray(values, dtype=F32).tobytes()


def unpack_f32(blob: bytes | None) -> np.ndarray:
    return np.frombuffer(blob or b"", dtype=F32)


def pack_runs(values) -> bytes:
    """Run-length encode ints as int32 (value, count) pairs: versions are long runs of one value."""
    if isinstance(values, list) and values and values.count(values[0]) == len(values):  # one run: no numpy
        return pack_i32([values[0], len(values)])
    a = np.asarray(values, dtype=np.int64)
    if a.size == 0:
        return b""
    starts = np.flatnonzero(np.concatenate(([True], a[1:] != a[:-1])))
    counts = np.diff(np.append(starts, a.size))
    return pack_i32(np.stack([a[starts], counts], axis=1).ravel())


def unpack_runs(blob: bytes | None) -> np.ndarray:
    pairs = unpack_i32(blob).reshape(-1, 2)
    return np.repeat(pairs[:, 0], pairs[:, 1]).astype(I32)


def pack_proximal(
    logprobs: np.ndarray, versions: np.ndarray, prox: np.ndarray, prox_versions: np.ndarray
) -> tuple[bytes | None, bytes | None]:
    """Encode proximal arrays against the behaviour arrays; (None, None) while nothing was recomputed.

    Logprob blob: ``b"S"`` + float32 values only at positions whose proximal version differs
    from the token version (elsewhere the proximal value is the behaviour logprob, docs/design.md section 2), or
    ``b"D"`` + every value when a caller broke that rule (kept exactly rather than "fixed").
    """
    pv_blob = None if np.array_equal(prox_versions, versions) else pack_runs(prox_versions)
    lp_bits, prox_bits = logprobs.view(np.int32), prox.view(np.int32)
    if np.array_equal(lp_bits, prox_bits):
        return None, pv_blob
    changed = prox_versions != versions
    if np.array_equal(lp_bits[~changed], prox_bits[~changed]):
        return b"S" + prox[changed].tobytes(), pv_blob
    return b"D" + prox.tobytes(), pv_blob


def unpack_proximal(
    logprobs: np.ndarray, versions: np.ndarray, lp_blob: bytes | None, pv_blob: bytes | None
) -> tuple[np.ndarray, np.ndarray]:
    prox_versions = versions if pv_blob is None else unpack_runs(pv_blob)
    if lp_blob is None:
        return logprobs, prox_versions
    if lp_blob[:1] == b"D":
        return unpack_f32(lp_blob[1:]), prox_versions
    prox = logprobs.copy()
    prox[prox_versions != versions] = unpack_f32(lp_blob[1:])
    return prox, prox_versions


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    if a.dtype == b.dtype and a.flags.c_contiguous and b.flags.c_contiguous and a.ctypes.data == b.ctypes.data:
        return n  # the same memory (a spliced prompt and its parent's ids share one id chain)
    if np.array_equal(a[:n], b[:n]):  # the usual case (a splice): one vectorised pass, no copies
        return n
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def common_bytes(a: bytes, b: bytes) -> int:
    """Length of the common prefix of two byte strings."""
    return common_prefix_len(np.frombuffer(a, dtype=np.uint8), np.frombuffer(b, dtype=np.uint8))
