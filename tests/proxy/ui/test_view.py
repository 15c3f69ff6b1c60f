"""A session's token pages and overview against the turns written to a real store: two spliced
turns (versions change inside the second) and a fork; the expected columns are built here from
the records themselves, not from the assembly the viewer uses."""

from __future__ import annotations

import numpy as np
import pytest

from proxy.store import Store, TurnRecord
from proxy.ui.view import IMAGE, REASONING, SPECIAL, TEXT, TOOL, Pieces, Segmenter, ViewCache, overview, page, summary
from tokenization import load_tokenizer, qwen3_tokenizer_dir

TOK = load_tokenizer(str(qwen3_tokenizer_dir()))


def _ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


def _turn(idx, parent, prompt, out, versions, *, spliced, fork=None, shift=0.0) -> TurnRecord:
    n = len(out)
    lp = [-0.1 - 0.01 * k for k in range(n)]
    return TurnRecord(f"t{idx}", "s", idx, parent, prompt, out, lp, versions, [x + shift for x in lp], [v + 1 for v in versions]
                      if shift else versions, spliced, fork, "stop", 1.0 + idx, {}, False, "chat", f"r{idx}")  # fmt: skip


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    p0 = _ids("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    o0 = _ids("<think>plan</think>ok<|im_end|>")
    p1 = p0 + o0 + _ids("\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n")
    o1 = _ids('<tool_call>\n{"name": "f"}\n</tool_call><|im_end|>')
    v1 = [0] * 3 + [1] * (len(o1) - 3)
    p2 = _ids("<|im_start|>system\nnew tools<|im_end|>\n<|im_start|>assistant\n")
    o2 = _ids("done<|im_end|>")
    store = Store(str(tmp_path_factory.mktemp("v") / "s.sqlite"))
    store.sessions.upsert("s")
    turns = [
        _turn(0, None, p0, o0, [0] * len(o0), spliced=False),
        _turn(1, "t0", p1, o1, v1, spliced=True, shift=0.25),
        _turn(2, "t0", p2, o2, [1] * len(o2), spliced=False, fork="tools_changed"),
    ]
    for t in turns:
        store.turns.add(t)
    yield store, turns
    store.close()


def test_pages_hold_each_samples_tokens_column_by_column(recorded):
    store, (t0, t1, t2) = recorded
    view = ViewCache(store, Segmenter(TOK)).get("s")
    head = summary(view, version=1)
    assert [t["edge"] for t in head["turns"]] == ["root", "spliced", "fork"]
    assert head["turns"][2]["fork_reason"] == "tools_changed"
    assert [s["n_tokens"] for s in head["samples"]] == [len(t1.prompt_ids) + len(t1.output_ids), len(t2.prompt_ids) + len(t2.output_ids)]

    ids = t1.prompt_ids + t1.output_ids
    out0 = range(len(t0.prompt_ids), len(t0.prompt_ids) + len(t0.output_ids))
    out1 = range(len(t1.prompt_ids), len(ids))
    pieces = Pieces(TOK)
    got = {k: [] for k in ("ids", "text", "mask", "version", "logprob", "proximal", "proximal_version", "src", "turn", "seg")}
    for start in range(0, len(ids), 7):  # pages of 7 tokens, joined
        pg = page(view, pieces, 0, start, 7)
        assert (pg["start"], pg["end"]) == (start, min(len(ids), start + 7))
        for k in got:
            got[k] += pg[k]
    assert got["ids"] == ids
    assert got["text"] == [TOK.decode([i]) for i in ids]
    sampled = [int(i in out0 or i in out1) for i in range(len(ids))]
    assert got["mask"] == got["src"] == sampled
    assert got["version"] == [-1] * out0.start + t0.versions + [-1] * (out1.start - out0.stop) + t1.versions
    f32 = lambda xs: np.asarray(xs, np.float32).astype(np.float64).tolist()  # noqa: E731
    assert got["logprob"] == [0.0] * out0.start + f32(t0.output_logprobs) + [0.0] * (out1.start - out0.stop) + f32(t1.output_logprobs)
    assert got["proximal"][out1.start :] == f32(t1.proximal_logprobs_t)
    assert got["proximal_version"][out1.start :] == t1.proximal_versions
    assert got["turn"] == [0] * out0.stop + [1] * (len(ids) - out0.stop)
    think = [TOK.convert_tokens_to_ids(x) for x in ("<think>", "</think>", "<tool_call>", "</tool_call>")]
    a, b = ids.index(think[0]), ids.index(think[1])
    c, d = ids.index(think[2]), ids.index(think[3])
    assert set(got["seg"][a : b + 1]) == {REASONING} and set(got["seg"][c : d + 1]) == {TOOL}
    assert got["seg"][ids.index(TOK.convert_tokens_to_ids("<|im_start|>"))] == SPECIAL
    assert got["seg"][ids.index(TOK.convert_tokens_to_ids("user"))] == TEXT
    assert IMAGE not in got["seg"]


@pytest.mark.parametrize("buckets", [4000, 5])
def test_the_overview_summarises_runs_of_tokens(recorded, buckets):
    store, (t0, t1, _) = recorded
    view = ViewCache(store, Segmenter(TOK)).get("s")
    o = overview(view, 0, buckets)
    out0 = range(len(t0.prompt_ids), len(t0.prompt_ids) + len(t0.output_ids))
    ids = t1.prompt_ids + t1.output_ids
    n = len(ids)
    out1 = range(len(t1.prompt_ids), n)
    assert o["n_tokens"] == n and len(o["starts"]) == min(buckets, n)
    ends = o["starts"][1:] + [n]
    assert all(a < b for a, b in zip(o["starts"], ends))
    versions = np.full(n, -1)
    versions[out0.start : out0.stop] = t0.versions
    versions[out1.start :] = t1.versions
    lp = np.zeros(n, np.float32)
    lp[out0.start : out0.stop] = t0.output_logprobs
    lp[out1.start :] = t1.output_logprobs
    for b, (a, e) in enumerate(zip(o["starts"], ends)):
        assert o["version"][b] == versions[a:e].max()
        inside = [i for i in range(a, e) if i in out1]
        if inside and all(i in out1 for i in range(a, e)):
            assert o["logprob"][b] == pytest.approx(float(lp[a:e].min()))
            assert o["delta"][b] == pytest.approx(0.25, abs=1e-6)
    if buckets >= n:  # one token per run: the last run is the last sampled token
        assert o["version"][-1] == t1.versions[-1] and o["src"][-1] == 1.0


@pytest.mark.parametrize("train_auxiliary", [False, True])
def test_turns_carry_their_role_and_side_calls_are_shown_as_pulled_or_not(tmp_path, train_auxiliary):
    """The samples listed are exactly the ones a pull hands out (same ids); a side call a pull
    leaves out is listed after them, marked, so its text can still be read."""
    import dataclasses

    p0 = _ids("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    o0 = _ids("ok<|im_end|>")
    pt = _ids("<|im_start|>user\nWrite a title.<|im_end|>\n<|im_start|>assistant\n")
    ot = _ids("Greeting<|im_end|>")
    turns = [
        _turn(0, None, p0, o0, [0] * len(o0), spliced=False),
        dataclasses.replace(_turn(1, None, pt, ot, [0] * len(ot), spliced=False), role="auxiliary"),
    ]
    with Store(str(tmp_path / "s.sqlite")) as store:
        store.pool.train_auxiliary = train_auxiliary
        store.sessions.upsert("s")
        for t in turns:
            store.turns.add(t)
        head = summary(ViewCache(store, Segmenter(TOK)).get("s"), version=0)
        pulled = [s.sample_id for s in store.pool.samples(["s"])]
    assert [t["role"] for t in head["turns"]] == ["main", "auxiliary"]
    assert head["roles"] == {"main": 1, "auxiliary": 1}
    listed = [(s["sample_id"], s["role"], s["pulled"]) for s in head["samples"]]
    if train_auxiliary:
        assert listed == [("s:0", "main", True), ("s:1", "auxiliary", True)]
    else:
        assert listed == [("s:0", "main", True), ("s:side0", "auxiliary", False)]
    assert [sid for sid, _, was_pulled in listed if was_pulled] == pulled
    side = head["samples"][1]
    assert side["n_tokens"] == len(pt) + len(ot) and side["loss_tokens"] == len(ot)
    assert head["turns"][1]["placement"] == {"sample": 1, "context_start": 0, "start": len(pt), "length": len(ot)}
