"""``HistoryHashes`` continues a kept hash only where the history really is the same: every
digest equals the one hashed from scratch (the reference), whatever was resent, edited,
dropped or added."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenization.conversation import HistoryHash, HistoryHashes, Message, ToolCall

LONG = "the kernel returns a tensor 123456 " * 1200  # ~42K characters: over the 32K threshold


def _fresh(msgs, edits=False) -> tuple:
    h = HistoryHash(edits=edits).extend(msgs)
    return h.hexdigest(), h.edit_hexdigests() if edits else None


def _got(h: HistoryHash, edits=False) -> tuple:
    return h.hexdigest(), h.edit_hexdigests() if edits else None


def _turn(i: int) -> list[Message]:
    call = ToolCall(id=f"c{i}", name="bash", arguments='{"cmd": "ls %d"}' % i)
    return [Message("assistant", "", tool_calls=(call,)), Message("tool", f"out {i}", tool_call_id=f"c{i}")]


def test_a_resent_history_is_continued_and_an_edited_one_hashed_again():
    hashes = HistoryHashes()
    base = [Message("system", "You are terse."), Message("user", LONG)]
    history = base + _turn(0)
    assert _got(hashes.hash(history)) == _fresh(history) and hashes.reused == 0
    longer = history + _turn(1)
    assert _got(hashes.hash(longer)) == _fresh(longer) and hashes.reused == 1
    # the long message edited in the middle (same length, same first 64 characters): no reuse
    edited = [base[0], Message("user", LONG[:20_000] + "X" + LONG[20_001:])] + _turn(0) + _turn(1)
    assert _got(hashes.hash(edited)) == _fresh(edited) and hashes.reused == 1
    # a retry of an earlier, shorter history, then the edit-tolerant forms
    assert _got(hashes.hash(history)) == _fresh(history)
    assert _got(hashes.hash(longer, edits=True), True) == _fresh(longer, True)
    assert _got(hashes.hash(longer + _turn(2), edits=True), True) == _fresh(longer + _turn(2), True)


def test_short_histories_are_not_kept_and_memory_is_bounded():
    hashes = HistoryHashes(max_chars=100_000)
    short = [Message("system", "s"), Message("user", "hi")]
    assert _got(hashes.hash(short)) == _fresh(short) and not hashes._kept
    for k in range(5):  # five sessions of ~42K characters each: at most two fit
        hashes.hash([Message("system", f"session {k}"), Message("user", LONG)])
    assert len(hashes._kept) == 2 and hashes._chars <= 100_000


_messages = st.lists(
    st.sampled_from(
        [Message("user", LONG), Message("user", LONG + "!"), Message("assistant", "ok"), Message("assistant", "ok", reasoning="r"),
         Message("assistant", " ok "), Message("tool", "1", tool_call_id="a"), Message("tool", "1", tool_call_id="b"),
         Message("system", "You are terse."), Message("system", "You are brief.")]
    ),
    min_size=0, max_size=6,
)  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(st.lists(_messages, min_size=1, max_size=6), st.booleans())
def test_every_digest_equals_the_one_hashed_from_scratch(requests, edits):
    """A sequence of requests from one client: each its own history (often a longer one of the
    same session, sometimes a different or edited one); messages that differ only where the
    fingerprint does not look (reasoning, call ids, spaces around an answer) included."""
    hashes = HistoryHashes()
    prefix = [Message("system", "You are terse."), Message("user", LONG)]
    for extra in requests:
        msgs = prefix + extra
        assert _got(hashes.hash(msgs, edits=edits), edits) == _fresh(msgs, edits)
