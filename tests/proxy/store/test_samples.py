"""Longest-active-prefix sample assembly (docs/design.md section 5, seed 002)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from proxy.store import samples as samples_mod
from proxy.store.records import SessionRecord
from proxy.store.samples import assemble_samples


def session(**kw) -> SessionRecord:
    base = dict(session_id="s", group_id="g", group_size=None, reward=1.5, closed=True, created_at=0.0, metadata={})
    base.update(kw)
    return SessionRecord(**base)


def seed_002_turns(make_turn):
    """The 4-step rollback trajectory; logprob of token t in turn k is -(10k + t), versions 10k + t."""

    def turn(k, prompt, output):
        return make_turn(
            "s",
            k,
            prompt,
            output,
            logprobs=[-(10 * k + t) for t in output],
            version=[10 * k + t for t in output],
        )

    return [
        turn(0, [1, 2], [3, 4]),
        turn(1, [1, 2, 3, 4, 5], [6]),
        turn(2, [1, 2], [3, 4, 5, 6, 7]),
        turn(3, [1, 2, 3, 4, 5, 6, 7, 8], [9]),
    ]


def lists(sample) -> SimpleNamespace:
    """The sample with its NumPy arrays as Python lists, so they compare with ``==``."""
    return SimpleNamespace(**sample.to_dict())


def check_seed_002(out):
    assert len(out) == 2
    a, b = map(lists, out)
    for s in out:
        n = len(s.input_ids)
        assert all(len(x) == n for x in (s.loss_mask, s.logprobs, s.versions, s.proximal_logprobs_t, s.proximal_versions))
    # sample A: turns 0 and 1
    assert a.input_ids == [1, 2, 3, 4, 5, 6]
    assert a.loss_mask == [0, 0, 1, 1, 0, 1]
    assert a.logprobs == [0.0, 0.0, -3.0, -4.0, 0.0, -16.0]
    assert a.versions == [-1, -1, 3, 4, -1, 16]
    assert a.proximal_logprobs_t == a.logprobs
    assert a.proximal_versions == a.versions
    assert a.turn_ids == ["s-t0", "s-t1"]
    # sample B: turns 2 and 3; token 7 stays a sampled token of turn 2
    assert b.input_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert b.loss_mask == [0, 0, 1, 1, 1, 1, 1, 0, 1]
    assert b.logprobs == [0.0, 0.0, -23.0, -24.0, -25.0, -26.0, -27.0, 0.0, -39.0]
    assert b.versions == [-1, -1, 23, 24, 25, 26, 27, -1, 39]
    assert b.proximal_versions == b.versions
    assert b.turn_ids == ["s-t2", "s-t3"]


def test_seed_002_longest_prefix(make_turn, caplog):
    with caplog.at_level(logging.WARNING, logger="proxy.store.samples"):
        out = assemble_samples(session(), seed_002_turns(make_turn))
    check_seed_002(out)
    assert out[0].sample_id == "s:0" and out[1].sample_id == "s:1"
    assert all(s.reward == 1.5 and s.group_id == "g" and s.session_id == "s" for s in out)
    assert any("ambiguous prefix" in r.message and "[6, 7]" in r.message for r in caplog.records)


def test_seed_002_fails_with_first_match(make_turn, monkeypatch):
    monkeypatch.setattr(samples_mod, "_choose", lambda matches: matches[0])
    out = assemble_samples(session(), seed_002_turns(make_turn))
    with pytest.raises(AssertionError):
        check_seed_002(out)
    # the seed's bug exactly: B's sampled token 7 filed in A as prompt
    assert out[0].input_ids[:8].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert out[0].loss_mask[6] == 0


def test_order_follows_index_not_list_order(make_turn):
    turns = seed_002_turns(make_turn)
    check_seed_002(assemble_samples(session(), list(reversed(turns))))


def test_spliced_session_is_one_sample_with_proximal_values(make_turn):
    t0 = make_turn("s", 0, [5, 6], [7, 8], version=[0, 1])
    t0.proximal_logprobs_t = [-0.5, t0.output_logprobs[1]]
    t0.proximal_versions = [1, 1]
    t1 = make_turn("s", 1, [5, 6, 7, 8, 100, 101], [9], version=1)
    (sample,) = assemble_samples(session(), [t0, t1])
    s = lists(sample)
    assert s.input_ids == [5, 6, 7, 8, 100, 101, 9]
    assert s.loss_mask == [0, 0, 1, 1, 0, 0, 1]
    assert s.logprobs == [0.0, 0.0, -1 - 1 / 1024, -1 - 2 / 1024, 0.0, 0.0, -2 - 1 / 1024]
    assert s.versions == [-1, -1, 0, 1, -1, -1, 1]
    assert s.proximal_logprobs_t == [0.0, 0.0, -0.5, -1 - 2 / 1024, 0.0, 0.0, -2 - 1 / 1024]
    assert s.proximal_versions == [-1, -1, 1, 1, -1, -1, 1]
    d = sample.to_dict()
    assert d["input_ids"] == s.input_ids and d["sample_id"] == "s:0" and d["reward"] == 1.5


def test_fork_starts_new_sample_and_leaves_earlier_alone(make_turn):
    t0 = make_turn("s", 0, [1, 2], [3])
    t1 = make_turn("s", 1, [1, 2, 3, 4], [5])
    t2 = make_turn("s", 2, [1, 9, 3, 4], [6])  # history edited
    out = assemble_samples(session(), [t0, t1, t2])
    assert [s.input_ids.tolist() for s in out] == [[1, 2, 3, 4, 5], [1, 9, 3, 4, 6]]
    assert [s.loss_mask.tolist() for s in out] == [[0, 0, 1, 0, 1], [0, 0, 0, 0, 1]]


def test_empty_session():
    assert assemble_samples(session(), []) == []


def test_turns_sampled_with_the_agents_settings_mark_the_sample_untrainable():
    from proxy.store.records import SessionRecord, TurnRecord
    from proxy.store.samples import assemble_samples

    def turn(i, prompt, out, trainable):
        n = len(out)
        return TurnRecord(turn_id=f"t{i}", session_id="s", index=i, parent_turn_id=None, prompt_ids=prompt, output_ids=out,
                          output_logprobs=[-0.1] * n, versions=[0] * n, proximal_logprobs_t=[-0.1] * n,
                          proximal_versions=[0] * n, spliced=False, fork_reason=None, finish_reason="stop", created_at=0.0,
                          requested_sampling={"trainable": trainable}, drift=False, api="chat", response_id=f"r{i}")

    session = SessionRecord("s", None, None, 1.0, True, 0.0)
    (a,) = assemble_samples(session, [turn(0, [1, 2], [3], True), turn(1, [1, 2, 3, 4], [5], False)])
    assert a.to_dict()["trainable"] is False
    (b,) = assemble_samples(session, [turn(0, [1, 2], [3], True)])
    assert b.to_dict()["trainable"] is True


@pytest.mark.parametrize("order", [[0, 1, 2, 3], [2, 0, 3, 1]])
def test_turns_streamed_from_the_store_give_the_seed_002_samples(store, make_turn, order):
    """``TurnTable.iter_tokens`` decodes prompts from their stored bases one turn at a time (and
    in index order even when turns were committed out of order)."""
    store.sessions.upsert("s", group_id="g")
    turns = seed_002_turns(make_turn)
    for k in order:
        store.turns.add(turns[k])
    store.sessions.set_reward("s", 1.5)
    with store.db.read(snapshot=True) as c:
        streamed = store.turns.iter_tokens(c, "s")
        assert not isinstance(streamed, list)
        check_seed_002(assemble_samples(store.sessions.get("s"), streamed))


def test_long_spliced_session_streams_with_prompts_from_bases(store, make_turn):
    """40 spliced turns: every prompt rebuilt from the previous turn's tokens, identical to what was stored."""
    store.sessions.upsert("L")
    prompt, turns = list(range(1, 50)), []
    for k in range(40):
        t = make_turn("L", k, prompt, [1000 + 10 * k + j for j in range(5)], parent=f"L-t{k - 1}" if k else None)
        store.turns.add(t)
        turns.append(t)
        prompt = prompt + t.output_ids + [7, 7, k]
    store.sessions.set_reward("L", 1.0)
    with store.db.read(snapshot=True) as c:
        streamed = [(t.turn_id, t.prompt_ids.tolist(), t.output_ids.tolist()) for t in store.turns.iter_tokens(c, "L")]
    assert streamed == [(t.turn_id, t.prompt_ids, t.output_ids) for t in turns]
    (s,) = store.pool.samples(["L"])
    assert s.input_ids.tolist() == turns[-1].prompt_ids + turns[-1].output_ids
    assert int(s.loss_mask.sum()) == 40 * 5 and [t.start for t in s.turns] == [len(t.prompt_ids) for t in turns]
