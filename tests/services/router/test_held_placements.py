"""A placement ranked and not yet committed counts in the router's next rankings
(router/held_placements.py), so a burst ranked before any of it is committed spreads.

The first tests take HeldPlacements alone; the rest run PrefixRouter and the Serve request
router on a real Redis with model-free workers, the Serve router driven as Serve's handle
does (testlib/serve_router.py)."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from baton.services.roles import Role
from baton.services.router import PrefixRouter, RankedWorker, WorkerLoad, WorkerView
from baton.services.router.held_placements import HeldPlacements
from testlib.fake_clock import FakeClock
from testlib.serve_router import candidates, choose, pending, rank, serve_router, wait_ranked


def view(worker_id: str, free: int = 100, cached: int = 0) -> WorkerView:
    return WorkerView(worker_id, WorkerLoad(num_free_kv_blocks=free, num_kv_blocks=100), 0, cached, 0, 0)


def test_a_hold_counts_as_load_until_released_or_expired():
    clock = FakeClock(0.0)
    held = HeldPlacements(ttl_s=5.0, clock=clock)
    held.hold("k1", RankedWorker("a", 0.0, 0, 40))
    held.hold("k2", RankedWorker("a", 0.0, 0, 8))
    held.hold("k3", RankedWorker("b", 0.0, 0, 16))
    a, b, c = held.apply([view("a"), view("b"), view("c")])
    assert (a.num_requests, a.num_queued_tokens, a.num_free_blocks(16)) == (2, 48, 97)
    assert (b.num_requests, b.num_queued_tokens, b.num_free_blocks(16)) == (1, 16, 99)
    assert (c.num_requests, c.num_queued_tokens) == (0, 0)

    held.hold("k1", RankedWorker("b", 0.0, 0, 40))  # ranked again: moves, not added
    held.release("k2")
    held.release("never held")
    a, b = held.apply([view("a"), view("b")])
    assert (a.num_requests, b.num_requests, b.num_queued_tokens) == (0, 2, 56)

    clock.now = 5.0  # a call Serve dropped before sending leaves no callback: its hold ends anyway
    assert [v.num_requests for v in held.apply([view("a"), view("b")])] == [0, 0] and len(held) == 0


def test_a_held_prompt_counts_as_cached_for_the_prefix_it_shares():
    held = HeldPlacements(ttl_s=5.0)
    held.hold("k", RankedWorker("a", 0.0, 1, 12), [b"h0", b"h1", b"h2", b"h3"])
    a, b = held.apply([view("a", cached=1), view("b", cached=2)], [b"h0", b"h1", b"h2", b"x3", b"x4"])
    assert (a.num_cached_blocks, b.num_cached_blocks) == (3, 2)  # b holds no hold: its own credit stays
    (a,) = held.apply([view("a")], [b"x0", b"h1"])  # a chained hash: no shared first block, no prefix
    assert a.num_cached_blocks == 0 and a.num_requests == 1

    blind = HeldPlacements(ttl_s=5.0, credit_prefix=False)  # index.speculative_ttl_s = 0
    blind.hold("k", RankedWorker("a", 0.0, 0, 16), [b"h0", b"h1"])
    assert blind.apply([view("a")], [b"h0", b"h1"])[0].num_cached_blocks == 0


def test_a_ttl_must_be_positive():
    with pytest.raises(ValueError, match="ttl_s must be positive, got 0"):
        HeldPlacements(ttl_s=0)


def _start_decode(config, workers, *names: str) -> None:
    for name in names:
        workers.start(config, name, Role.DECODE, address=candidates("decode", name)[0].replica_id.to_full_id_str())
    wait_ranked(config, len(names))


def test_held_rankings_of_a_burst_spread_over_idle_workers(config, workers):
    _start_decode(config, workers, "a", "b")
    router = PrefixRouter.from_config(config)
    firsts = [router.route_decode(f"r{i}", 8, record=False, hold=f"k{i}").best for i in range(8)]
    assert sorted(Counter(router.worker_info(w.worker_id).address for w in firsts).values()) == [4, 4]
    for i, worker in enumerate(firsts):
        router.commit(worker, held=f"k{i}")
    assert len(router._held) == 0


def test_a_call_ranked_again_does_not_count_against_its_own_first_choice(config, workers):
    _start_decode(config, workers, "a", "b")
    router = PrefixRouter.from_config(config)
    first = router.route_decode("r", 8, record=False, hold="k").best.worker_id
    assert router.route_decode("r", 8, record=False, hold="k").best.worker_id == first
    # Every ranking of this router counts the hold, a probe too, and a probe holds nothing.
    costs = {w.worker_id: w.cost for w in rank(router, "decode").ranked}
    assert costs[first] == 1.0 and sorted(costs.values()) == [0.0, 1.0] and len(router._held) == 1


def test_a_placement_is_either_recorded_or_held(config):
    router = PrefixRouter.from_config(config)
    with pytest.raises(ValueError, match="either recorded now or held"):
        router.route_decode("r", 8, hold="k")


async def test_a_burst_through_the_serve_router_spreads_then_commits(config, workers):
    _start_decode(config, workers, "a", "b")
    router = serve_router(config)
    replicas = candidates("decode", "a", "b")
    requests = [pending(i) for i in range(8)]
    groups = await asyncio.gather(*(choose(router, replicas, request) for request in requests))
    assert Counter(g[0][0] for g in groups) == {"a": 4, "b": 4}  # all ranked before any was committed
    by_name = {r.replica_id.unique_id: r.replica_id for r in replicas}
    for request, ranked in zip(requests, groups):
        router.on_request_routed(request, by_name[ranked[0][0]], None)
    assert len(router.router._held) == 0 and len(router._in_flight) == 8
    for request, ranked in zip(requests, groups):
        router.on_request_completed(by_name[ranked[0][0]], request.metadata.internal_request_id)
    assert router._in_flight == {} and router._routing == {}


async def test_calls_that_go_nowhere_ranked_release_their_holds(config, workers):
    _start_decode(config, workers, "a")
    router = serve_router(config)
    replicas = candidates("decode", "a", "new")  # "new" has not registered: ranked after "a"
    routed_elsewhere, failed, abandoned = pending(0), pending(1), pending(2)
    for request in (routed_elsewhere, failed, abandoned):
        assert await choose(router, replicas, request) == [["a"], ["new"]]
    assert len(router.router._held) == 3

    router.on_request_routed(routed_elsewhere, replicas[1].replica_id, None)
    router.on_request_completed(replicas[0].replica_id, failed.metadata.internal_request_id)  # failed unsent
    assert len(router.router._held) == 1 and router._in_flight == {}

    # A call cancelled while it queued in the handle gets neither callback: the first ranking
    # after routing_ttl_s forgets it and ends its hold.
    router._routing[abandoned.metadata.internal_request_id].ranked_at -= router.routing_ttl_s
    await choose(router, replicas, later := pending(3))
    assert list(router._routing) == [later.metadata.internal_request_id] and len(router.router._held) == 1
    router.on_request_routed(abandoned, replicas[0].replica_id, None)  # forgotten: nothing to commit
    assert router._in_flight == {}
