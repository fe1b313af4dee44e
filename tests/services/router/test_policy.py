"""Placement policies: imbalance guard first, affinity second, deterministic ties and draws."""

from __future__ import annotations

from collections import Counter

import pytest
from baton.services.router import (
    LoadPolicy,
    PlacementReason,
    PolicyConfig,
    PrefixAwarePolicy,
    RoutingRequest,
    WorkerLoad,
    WorkerView,
)

BLOCK = 16


def view(worker_id, cached=0, running=0, waiting=0, queued=0, pending=0, pending_tokens=0, free=100, stored=0, warm=0):
    load = WorkerLoad(running, waiting, queued, free, 128, warm)
    return WorkerView(worker_id, load, 0, cached, pending, pending_tokens, stored)


def request(num_tokens=256, request_id="r") -> RoutingRequest:
    return RoutingRequest(request_id, num_tokens, BLOCK)


def test_no_candidates_means_no_workers():
    assert PrefixAwarePolicy().rank(request(), []).reason is PlacementReason.NO_WORKERS
    assert LoadPolicy().rank(request(), []).best is None


def test_the_worker_holding_the_prefix_wins_and_all_are_ranked():
    placement = PrefixAwarePolicy().rank(request(), [view("a"), view("b", cached=10), view("c", cached=4)])
    assert placement.reason is PlacementReason.PREFIX
    assert placement.worker_ids == ["b", "c", "a"]
    assert placement.best.num_cached_blocks == 10 and placement.best.num_new_tokens == 256 - 160


def test_without_a_prefix_the_shortest_queue_wins():
    placement = PrefixAwarePolicy().rank(request(), [view("a", queued=300), view("b", queued=20), view("c", queued=90)])
    assert placement.reason is PlacementReason.LOAD
    assert placement.worker_ids == ["b", "c", "a"]


def test_a_warm_worker_loses_once_its_queue_outweighs_the_prefill_it_saves():
    warm = view("warm", cached=8, queued=100)  # saves 128 tokens, has 100 queued: still cheaper
    assert PrefixAwarePolicy().rank(request(), [warm, view("cold")]).best.worker_id == "warm"
    warm = view("warm", cached=8, queued=200)
    assert PrefixAwarePolicy().rank(request(), [warm, view("cold")]).best.worker_id == "cold"
    # overlap_weight 0 ignores the cache: load only
    assert PrefixAwarePolicy(PolicyConfig(overlap_weight=0)).rank(
        request(), [view("a", cached=8, queued=5), view("b")]
    ).worker_ids == ["b", "a"]


def test_the_last_prompt_token_is_never_counted_as_cached():
    # 32 tokens = 2 full blocks, both cached: the engine still computes the last token, so
    # only 1 block is usable and 16 tokens remain to compute.
    best = PrefixAwarePolicy().rank(request(32), [view("a", cached=2)]).best
    assert best.num_cached_blocks == 1 and best.num_new_tokens == 16


def test_pending_placements_count_as_load():
    a, b = view("a", pending=3, pending_tokens=600), view("b", running=1, queued=10)
    assert a.num_requests == 3 and a.num_queued_tokens == 600
    assert PrefixAwarePolicy().rank(request(), [a, b]).best.worker_id == "b"


@pytest.mark.parametrize(
    ("requests_a", "requests_b", "imbalanced"),
    [(17, 0, True), (16, 0, False), (40, 30, False), (60, 30, True)],
)
def test_imbalance_guard_needs_both_thresholds(requests_a, requests_b, imbalanced):
    policy = PrefixAwarePolicy(PolicyConfig(balance_abs_threshold=16, balance_rel_threshold=1.5))
    candidates = [view("a", cached=16, running=requests_a), view("b", running=requests_b)]
    placement = policy.rank(request(), candidates)
    assert (placement.reason is PlacementReason.IMBALANCE) == imbalanced
    assert placement.best.worker_id == ("b" if imbalanced else "a")


def test_ties_break_the_same_whatever_the_input_order():
    candidates = [view("c"), view("a"), view("b")]
    first = PrefixAwarePolicy().rank(request(), candidates).worker_ids
    for order in (candidates[::-1], candidates[1:] + candidates[:1]):
        assert PrefixAwarePolicy().rank(request(), order).worker_ids == first
        assert LoadPolicy().rank(request(), order).worker_ids == ["a", "b", "c"]  # decode: by worker id


def test_prefill_ties_follow_the_prefix_and_spread_over_workers():
    policy, idle = PrefixAwarePolicy(), [view(w) for w in "abcd"]

    def first(key: bytes, request_id: str = "r") -> str:
        return policy.rank(RoutingRequest(request_id, 256, BLOCK, key), idle).best.worker_id

    # the same first block ties the same way, whatever the request
    assert len({first(b"prefix-1", f"r{i}") for i in range(20)}) == 1
    # 400 different prefixes: each worker takes about a quarter (no favoured id)
    counts = Counter(first(f"prefix-{i}".encode()) for i in range(400))
    assert set(counts) == set("abcd") and min(counts.values()) > 60, counts


def test_a_prefix_nobody_holds_goes_to_the_worker_holding_least():
    """Idle workers split new prefixes between them instead of all going to the first id."""
    candidates = [view("a", stored=300), view("b", stored=40), view("c", stored=120)]
    assert PrefixAwarePolicy().rank(request(), candidates).worker_ids == ["b", "c", "a"]
    # cost and load still come first
    warm = [view("a", cached=4, stored=300), view("b", stored=0)]
    assert PrefixAwarePolicy().rank(request(), warm).best.worker_id == "a"
    busy = [view("a", running=1, stored=0), view("b", stored=300)]
    assert PrefixAwarePolicy().rank(request(), busy).best.worker_id == "b"


def test_a_new_prefix_goes_where_it_evicts_no_warm_blocks():
    # 256 tokens need 16 blocks. "full" has 20 free blocks, 15 of them warm: placing there
    # evicts 11 warm blocks (176 tokens to recompute later); "roomy" evicts none.
    full, roomy = view("full", free=20, warm=15), view("roomy", free=60, warm=10, queued=100)
    placement = PrefixAwarePolicy().rank(request(), [full, roomy])
    assert placement.worker_ids == ["roomy", "full"]
    assert [r.num_evicted_blocks for r in placement.ranked] == [0, 11]
    assert placement.ranked[1].cost == 256 + 11 * BLOCK
    # ... unless its queue costs more than the evictions; eviction_weight 0 ignores them
    assert PrefixAwarePolicy().rank(request(), [full, view("roomy", queued=200)]).best.worker_id == "full"
    assert PrefixAwarePolicy(PolicyConfig(eviction_weight=0)).rank(request(), [full, roomy]).best.worker_id == "full"


def test_placements_newer_than_the_report_use_up_cold_blocks():
    # 30 cold free blocks, but a pending placement of 320 tokens takes 20 of them
    busy = view("a", free=30, pending=1, pending_tokens=320)
    assert PrefixAwarePolicy().rank(request(), [busy]).best.num_evicted_blocks == 6


def test_a_warm_worker_pays_for_evictions_only_beyond_its_cold_blocks():
    # both caches are full of live prefixes: the warm worker needs 8 new blocks, the cold one 16
    warm, cold = view("warm", cached=8, free=10, warm=10), view("cold", free=10, warm=10)
    ranked = PrefixAwarePolicy().rank(request(), [warm, cold]).ranked
    assert [(r.worker_id, r.num_evicted_blocks, r.cost) for r in ranked] == [
        ("warm", 8, 128 + 128),
        ("cold", 16, 256 + 256),
    ]


def test_temperature_spreads_ties_reproducibly_by_request_id():
    policy = PrefixAwarePolicy(PolicyConfig(temperature=0.5))
    candidates = [view(name) for name in "abcd"]
    firsts = [policy.rank(request(request_id=f"r{i}"), candidates).best.worker_id for i in range(400)]
    counts = Counter(firsts)
    assert set(counts) == set("abcd") and min(counts.values()) > 60
    again = [policy.rank(request(request_id=f"r{i}"), candidates[::-1]).best.worker_id for i in range(400)]
    assert again == firsts


def test_temperature_still_prefers_much_cheaper_workers():
    policy = PrefixAwarePolicy(PolicyConfig(temperature=0.1))
    candidates = [view("warm", cached=15), view("cold")]
    firsts = Counter(policy.rank(request(request_id=f"r{i}"), candidates).best.worker_id for i in range(200))
    assert firsts["warm"] > 190


def test_decode_prefers_room_then_fewer_requests_then_free_blocks():
    candidates = [
        view("full", free=3),  # 256 tokens need 17 blocks
        view("busy", running=5, free=100),
        view("idle-small", free=40),
        view("idle-big", free=90),
    ]
    placement = LoadPolicy().rank(request(), candidates)
    assert placement.reason is PlacementReason.LOAD
    assert placement.worker_ids == ["idle-big", "idle-small", "busy", "full"]


def test_decode_counts_blocks_that_pending_placements_will_take():
    candidates = [view("a", free=30, pending_tokens=16 * 20), view("b", free=20)]
    assert LoadPolicy().rank(request(), candidates).worker_ids == ["b", "a"]


def test_bad_requests_are_refused():
    with pytest.raises(ValueError, match="at least one token"):
        RoutingRequest("r", 0, 16)
    with pytest.raises(ValueError, match="block_size"):
        RoutingRequest("r", 5, 0)
