"""Choosing a replica: least load, prefix hashing with bounded load, cool-down."""

from __future__ import annotations

from collections import Counter

from tidal_operator.router.picker import (
    EngineLoad, LoadTracker, bounded_capacity, choose_replica, estimated_queue, prompt_prefix, ring_order,
)
from tidal_operator.router.registry import Replica


def _replicas(*names: str) -> list[Replica]:
    return [Replica(pod_name=n, namespace="default", llmservice="m", url=f"http://{n}:8000", ready=True) for n in names]


def test_least_load_wins_and_ties_rotate() -> None:
    a, b, c = _replicas("a", "b", "c")
    loads = {a.key: 3, b.key: 1, c.key: 1}
    picked = {choose_replica([a, b, c], loads, tiebreak=t).pod_name for t in range(4)}
    assert picked == {"b", "c"}
    assert choose_replica([a, b, c], {a.key: 0, b.key: 1, c.key: 1}).pod_name == "a"
    assert choose_replica([], {}) is None


def test_cooling_replicas_are_skipped_unless_nothing_else_is_left() -> None:
    a, b = _replicas("a", "b")
    assert choose_replica([a, b], {a.key: 5}, cooling=frozenset({b.key})).pod_name == "a"
    assert choose_replica([b], {}, cooling=frozenset({b.key})).pod_name == "b"


def test_prefix_hash_is_sticky_and_spreads_different_prefixes() -> None:
    replicas = _replicas("a", "b", "c")
    first = choose_replica(replicas, {}, strategy="prefixHash", prefix_key="system: you are a pirate")
    for tiebreak in range(20):
        again = choose_replica(list(reversed(replicas)), {}, strategy="prefixHash",
                               prefix_key="system: you are a pirate", tiebreak=tiebreak)
        assert again == first
    spread = Counter(choose_replica(replicas, {}, strategy="prefixHash", prefix_key=f"system {i}").pod_name
                     for i in range(60))
    assert set(spread) == {"a", "b", "c"}


def test_bounded_load_moves_to_the_next_replica_on_the_ring() -> None:
    replicas = _replicas("a", "b", "c")
    key = "shared system prompt"
    order = ring_order([r.pod_name + ".default" for r in replicas], key)
    by_name = {r.pod_name + ".default": r for r in replicas}
    preferred, second = by_name[order[0]], by_name[order[1]]
    # cap = ceil((4 + 1) / 3 * 1.25) = 3: the preferred replica (load 3) is full.
    loads = {preferred.key: 3, second.key: 1}
    assert bounded_capacity(4, 3, 0.25) == 3
    assert choose_replica(replicas, loads, strategy="prefixHash", prefix_key=key) == second
    # Below the cap it stays put.
    assert choose_replica(replicas, {preferred.key: 1, second.key: 1}, strategy="prefixHash", prefix_key=key) == preferred


def test_bounded_load_keeps_every_replica_under_the_cap() -> None:
    replicas = _replicas("a", "b", "c", "d")
    tracker = LoadTracker()
    for _ in range(40):
        replica = tracker.pick(replicas, strategy="prefixHash", prefix_key="same prefix")
        tracker.acquire(replica)
    loads = sorted(tracker.outstanding.values())
    assert max(loads) <= bounded_capacity(39, 4, 0.25)
    assert sum(loads) == 40


def test_the_ring_moves_only_the_keys_of_a_removed_replica() -> None:
    names = ["a", "b", "c", "d"]
    keys = [f"prompt {i}" for i in range(200)]
    before = {k: ring_order(names, k)[0] for k in keys}
    after = {k: ring_order(["a", "b", "c"], k)[0] for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "d" for k in moved)


def test_tracker_counts_and_cools_down() -> None:
    a, b = _replicas("a", "b")
    tracker = LoadTracker(cooldown_s=10)
    tracker.acquire(a)
    tracker.acquire(a)
    tracker.release(a)
    assert tracker.outstanding == {a.key: 1}
    tracker.release(a)
    assert tracker.outstanding == {}
    tracker.mark_failed(b, now=100.0)
    assert tracker.cooling(now=105.0) == {b.key}
    assert tracker.cooling(now=111.0) == frozenset()
    assert tracker.pick([a, b], strategy="leastLoad", prefix_key=None, exclude=frozenset({a.key})) == b


def test_prompt_prefix() -> None:
    chat = {"model": "m", "messages": [{"role": "system", "content": "You are terse."},
                                       {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert prompt_prefix(chat, 256) == "m\x00system:You are terse.\nuser:hi\n"
    assert prompt_prefix(chat, 10) == "m\x00system:Y"
    assert prompt_prefix({"model": "m", "prompt": "Once upon"}, 256) == "m\x00Once upon"
    assert prompt_prefix({"model": "m", "prompt": ["first", "second"]}, 256) == "m\x00first"
    assert prompt_prefix({"model": "m", "prompt": [1, 2, 3]}, 256) == "m\x001 2 3"
    assert prompt_prefix({"model": "m", "input": "embed me"}, 256) == "m\x00embed me"
    # Adapters don't share KV with their base model, so the model is part of the key.
    assert prompt_prefix({"model": "a", "prompt": "x"}, 256) != prompt_prefix({"model": "b", "prompt": "x"}, 256)


def test_the_engines_own_queue_outweighs_this_routers_count() -> None:
    a, b = _replicas("a", "b")
    tracker = LoadTracker()
    tracker.acquire(a)
    tracker.acquire(b)
    tracker.report(a.key, running=4, waiting=6, kv_cache_usage=0.5)  # busy with others' requests
    tracker.report(b.key, running=1, waiting=0, kv_cache_usage=0.1)
    assert {tracker.pick([a, b], strategy="leastLoad", prefix_key=None).pod_name for _ in range(4)} == {"b"}
    # Requests sent since the report count on top of it; finished ones come off (not below ours).
    tracker.acquire(b)
    assert tracker.estimated_loads([a, b]) == {a.key: 10.0, b.key: 2.0}
    assert estimated_queue(EngineLoad(0, 0, 0, local_at_report=3), local_now=1) == 1.0
    assert estimated_queue(None, local_now=2) == 2.0


def test_prefix_affinity_gives_way_when_the_affine_engine_is_saturated() -> None:
    replicas = _replicas("a", "b", "c")
    key = "shared system prompt"
    by_name = {r.pod_name + ".default": r for r in replicas}
    preferred = by_name[ring_order(list(by_name), key)[0]]
    others = [r for r in replicas if r != preferred]
    assert choose_replica(replicas, {}, strategy="prefixHash", prefix_key=key) == preferred
    # Its engine queue (not this router's count) is over the bounded share: the ring moves on.
    busy = {preferred.key: 9.0}
    assert choose_replica(replicas, busy, strategy="prefixHash", prefix_key=key) in others
    # A saturated KV cache also moves it, to the replica with the lower load and KV usage.
    kv = {preferred.key: 0.99, others[0].key: 0.5, others[1].key: 0.0}
    assert choose_replica(replicas, {}, strategy="prefixHash", prefix_key=key, kv_usage=kv) in others
    assert choose_replica(replicas, {}, strategy="leastLoad", kv_usage=kv) == others[1]
