"""Consistent hashing: sticky sessions, minimal movement, ring-order failover."""

from __future__ import annotations

from collections import Counter

from engines.routing import HashRing

NODES = ["http://e0:1", "http://e1:1", "http://e2:1", "http://e3:1"]
SESSIONS = [f"sess-{i}" for i in range(2000)]


def test_same_session_same_replica_across_instances():
    a, b = HashRing(NODES), HashRing(list(reversed(NODES)))
    assert all(a.node_for(s) == b.node_for(s) for s in SESSIONS)


def test_removing_a_replica_moves_only_its_sessions():
    ring = HashRing(NODES)
    before = {s: ring.node_for(s) for s in SESSIONS}
    ring.remove("http://e2:1")
    after = {s: ring.node_for(s) for s in SESSIONS}
    moved = {s for s in SESSIONS if before[s] != after[s]}
    assert moved == {s for s in SESSIONS if before[s] == "http://e2:1"}
    # each moved session goes where the ring's failover order said it would
    full = HashRing(NODES)
    assert all(after[s] == full.preference(s)[1] for s in moved)


def test_adding_a_replica_only_takes_sessions_for_itself():
    ring = HashRing(NODES[:3])
    before = {s: ring.node_for(s) for s in SESSIONS}
    ring.add(NODES[3])
    changed = [s for s in SESSIONS if ring.node_for(s) != before[s]]
    assert changed and all(ring.node_for(s) == NODES[3] for s in changed)


def test_spread_is_even_and_preference_lists_every_replica_once():
    ring = HashRing(NODES)
    counts = Counter(ring.node_for(s) for s in SESSIONS)
    assert min(counts.values()) > len(SESSIONS) / len(NODES) * 0.6
    pref = ring.preference("sess-1")
    assert sorted(pref) == sorted(NODES) and pref[0] == ring.node_for("sess-1")
