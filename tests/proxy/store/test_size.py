"""Bytes on disk per generated token, measured on a 10k-token session."""

from __future__ import annotations

import numpy as np
import pytest

from proxy.store.records import TurnRecord
from proxy.store import Store


def write_session(store: Store, sid: str, *, turns: int, out_len: int, bridge: int, recompute: bool, rng) -> int:
    """A spliced agent session; returns generated tokens."""
    store.sessions.upsert(sid, group_id="grp", group_size=8)
    prompt = rng.integers(0, 151_000, 300).tolist()
    parent = None
    for k in range(turns):
        out = rng.integers(0, 151_000, out_len).tolist()
        lp = rng.normal(-1.0, 1.0, out_len).astype(np.float32).tolist()
        v = [k // 4] * out_len
        tid = f"turn_{sid}_{k:04d}"
        store.turns.add(
            TurnRecord(
                tid, sid, k, parent, prompt, out, lp, v, lp, v, k > 0, None, "stop", 0.0,
                {"temperature": 1.0, "top_p": 1.0, "mode": "trainable"}, False, "responses", f"resp_{tid}",
            ),
            fingerprints=[f"{tid:>64}".encode()[:12]],
        )  # fmt: skip
        if recompute:
            store.turns.update_proximal(tid, (np.asarray(lp) - 0.01).tolist(), [x + 1 for x in v])
        prompt = prompt + out + rng.integers(0, 151_000, bridge).tolist()
        parent = tid
    return turns * out_len


@pytest.mark.parametrize(
    "turns,out_len,bridge,recompute,limit",
    [
        (1, 10_000, 0, False, 8.5),  # ids 4 + logprobs 4; versions are one run
        (20, 500, 50, False, 12.0),  # + bridge tokens, per-turn rows and lookups
        (20, 500, 50, True, 16.0),  # + 4 bytes for every recomputed proximal logprob
    ],
)
def test_bytes_per_generated_token(tmp_path, turns, out_len, bridge, recompute, limit):
    rng = np.random.default_rng(0)
    store = Store(str(tmp_path / "size.db"))
    empty = store.stats()["db_bytes"]
    generated = 0
    for s in range(3):  # a few sessions so page granularity does not dominate
        generated += write_session(store, f"s{s}", turns=turns, out_len=out_len, bridge=bridge, recompute=recompute, rng=rng)
    stats = store.stats()
    per_token = (stats["db_bytes"] - empty) / generated
    print(f"\n{turns} turns x {out_len} tokens, recompute={recompute}: {per_token:.2f} bytes/generated token")
    assert stats["tokens"] == generated
    assert per_token <= limit
    # a spliced prompt is not stored again: only each turn's new tokens are
    with store.db.read() as c:
        (tail_bytes,) = c.execute("SELECT SUM(LENGTH(prompt_tail)) FROM turns WHERE session_id = 's0'").fetchone()
    assert tail_bytes == 4 * (300 + (turns - 1) * bridge)
    # round trip still exact after all the delta encoding
    (sample,) = store.turns.list("s0")[-1:]
    assert len(sample.prompt_ids) == 300 + (turns - 1) * (out_len + bridge)
    store.close()
