"""The router end to end on a real Redis, with model-free workers publishing real cache events."""

from __future__ import annotations

import logging
from collections import Counter

import pytest
from baton.services.engine.core.kv_events import KVCacheSnapshot
from baton.services.roles import Role
from baton.services.router import IndexConfig, PlacementReason, PrefixRouter, WorkerLoad
from testlib.fake_clock import FakeClock
from testlib.router_setup import make_config, make_index, make_info
from testlib.waiting import wait_until

PREFIX = list(range(1000, 1064))  # 16 blocks of 4 tokens


def prompt(i: int) -> list[int]:
    return PREFIX + [5000 + i, 6000 + i, 7000 + i, 8000 + i, 9000 + i]


def in_sync(index, agent, engine) -> bool:
    return index.cached_blocks(agent.info.worker_id) == engine.cached_block_hashes()


def warm(config, workers, *names):
    """Starts workers; the first one prefills PREFIX; returns the agents and engines by name."""
    started = {name: workers.start(config, name) for name in names}
    index = make_index(config)
    agent, engine = started[names[0]]
    engine.prefill(PREFIX)
    for agent, engine in started.values():
        wait_until(lambda a=agent, e=engine: in_sync(index, a, e) and a.counters.num_snapshots_sent, what="sync")
    return started


def test_prefix_placement_and_load_placement(config, workers):
    started = warm(config, workers, "a", "b")
    router = PrefixRouter.from_config(config)
    placement = router.route_prefill("r1", prompt(1))
    assert placement.reason is PlacementReason.PREFIX
    assert placement.worker_ids[0] == started["a"][0].info.worker_id and len(placement.worker_ids) == 2
    assert placement.best.num_cached_blocks == 16 and placement.best.num_new_tokens == 5
    assert router.worker_info(placement.worker_ids[0]).address == "replica-a"

    started["b"][1].extra_load = WorkerLoad(num_waiting=2, num_waiting_prefill_tokens=400)
    wait_until(lambda: max(v.load.num_waiting for v in make_index(config).query("prefill", [])) == 2)
    unrelated = router.route_prefill("r2", list(range(20_000, 20_040)))
    assert unrelated.reason is PlacementReason.LOAD
    assert unrelated.worker_ids[0] == started["a"][0].info.worker_id  # b is the busier one
    metrics = router.metrics()
    assert metrics["decisions_prefill_prefix"] == 1 and metrics["decisions_prefill_load"] == 1
    assert metrics["cached_blocks"] == 16 and metrics["redis_available"] == 1


def test_a_burst_on_one_prefix_spreads_once_the_imbalance_guard_trips(redis_server, workers):
    config = make_config(redis_server, balance_abs_threshold=8, balance_rel_threshold=1.5)
    started = warm(config, workers, "a", "b")
    by_id = {agent.info.worker_id: engine for agent, engine in started.values()}
    router = PrefixRouter.from_config(config)
    counts: Counter = Counter()
    for i in range(100):
        chosen = router.route_prefill(f"burst-{i}", prompt(i)).worker_ids[0]
        counts[chosen] += 1
        by_id[chosen].extra_load = WorkerLoad(num_waiting=counts[chosen])  # the request queues there
    assert router.metrics()["decisions_prefill_imbalance"] >= 1
    assert min(counts.values()) >= 40, counts


def test_a_restarted_worker_never_gets_placements_from_its_old_entries(config, workers):
    started = warm(config, workers, "a", "b")
    old_agent, old_engine = started["a"]
    index = make_index(config)
    old_engine.close()
    old_agent.close(deregister=False)  # a crash: the old epoch's entries stay behind
    new_agent, new_engine = workers.start(config, "a")
    wait_until(lambda: new_agent.counters.num_snapshots_sent, what="the new epoch's first snapshot")
    assert index.cached_blocks(old_agent.info.worker_id) == set()  # wiped at once, not after the TTL
    router = PrefixRouter.from_config(config)
    placement = router.route_prefill("r", prompt(0))
    assert old_agent.info.worker_id not in placement.worker_ids
    assert placement.reason is PlacementReason.LOAD and placement.best.num_cached_blocks == 0


def test_a_dead_workers_entries_are_ignored_after_its_ttl_and_collected(redis_server, workers):
    base = make_config(redis_server)
    config = base.model_copy(update={"index": IndexConfig(gc_interval_s=0.1)})
    started = warm(config, workers, "a", "b")
    dead_agent, dead_engine = started["a"]
    dead_engine.close()
    dead_agent.close(deregister=False)
    router = PrefixRouter.from_config(config)
    index = make_index(config)
    wait_until(lambda: dead_agent.info.worker_id not in router.route_prefill("probe", prompt(0)).worker_ids,
               timeout_s=3, what="the dead worker to drop out")  # fmt: skip
    assert router.route_prefill("r", prompt(1)).worker_ids == [started["b"][0].info.worker_id]
    wait_until(lambda: router.route_prefill("gc", prompt(2)) and router.metrics()["workers_collected"] == 1)
    assert index.cached_blocks(dead_agent.info.worker_id) == set()
    assert index.worker_infos([dead_agent.info.worker_id]) == {}


def seed_state(index) -> None:
    """Three workers with different prefixes and loads, written directly (no timing involved)."""
    from baton.services.router import PromptHasher

    hashes = PromptHasher(4).block_hashes(PREFIX)
    for i, (name, cached, load) in enumerate((("a", 16, 3), ("b", 8, 0), ("c", 0, 1))):
        info = make_info(name, epoch=f"{i + 1:024x}")  # the same ids in every run
        index.heartbeat(info, WorkerLoad(load, 0, load * 40, 100, 100), 60.0)
        index.replace_blocks(info.worker_id, KVCacheSnapshot(0, frozenset(hashes[:cached])))


def decisions(config, redis_server, router_of_request, temperature: float) -> list:
    redis_server.client().flushall()
    clock = FakeClock(10_000_000)
    config = config.model_copy(update={"policy": config.policy.model_copy(update={"temperature": temperature})})
    routers = [PrefixRouter(config, make_index(config, clock=clock)) for _ in range(2)]
    seed_state(routers[0].index)
    out = []
    for i in range(40):
        tokens = prompt(i) if i % 3 else list(range(30_000 + 50 * i, 30_000 + 50 * i + 30))
        router = routers[router_of_request(i)]
        placement = router.route_prefill(f"req-{i}", tokens)
        router.index.flush()  # the placement write is sent without waiting; here, wait for it
        out.append((placement.worker_ids, placement.reason))
    return out


def test_router_replicas_on_the_same_redis_state_decide_the_same(config, redis_server):
    for temperature in (0.0, 0.5):
        alternating = decisions(config, redis_server, lambda i: i % 2, temperature)
        only_first = decisions(config, redis_server, lambda i: 0, temperature)
        only_second = decisions(config, redis_server, lambda i: 1, temperature)
        assert alternating == only_first == only_second
        assert {reason for _, reason in alternating} >= {PlacementReason.PREFIX, PlacementReason.LOAD}


def test_redis_killed_mid_run_falls_back_to_load_then_resumes_prefix_routing(own_redis, workers, caplog):
    config = make_config(own_redis)
    started = warm(config, workers, "a", "b")
    warm_id = started["a"][0].info.worker_id
    router = PrefixRouter.from_config(config)
    assert router.route_prefill("before", prompt(0)).worker_ids[0] == warm_id

    own_redis.kill()
    with caplog.at_level(logging.WARNING, logger="baton.services.router"):
        during = [router.route_prefill(f"down-{i}", prompt(i)) for i in range(20)]
    assert {p.reason for p in during} == {PlacementReason.FALLBACK}
    assert len({p.worker_ids[0] for p in during}) == 2  # load-only, so the burst spreads
    assert router.metrics()["redis_available"] == 0 and router.metrics()["decisions_prefill_fallback"] == 20
    assert (
        sum("Redis is unavailable" in r.message for r in caplog.records if r.name.endswith("router.availability")) >= 1
    )
    assert sum("router: Redis is unavailable" in r.getMessage() for r in caplog.records) == 1  # logged once

    own_redis.start()
    index = make_index(config)
    wait_until(lambda: all(in_sync(index, a, e) for a, e in started.values()) and index.cached_blocks(warm_id),
               timeout_s=10, what="workers to republish")  # fmt: skip
    after = wait_until(lambda: (p := router.route_prefill("after", prompt(99))).reason is PlacementReason.PREFIX and p,
                       timeout_s=5, what="prefix routing to resume")  # fmt: skip
    assert after.worker_ids[0] == warm_id and router.metrics()["redis_available"] == 1


def test_no_workers_and_redis_never_reached(redis_server):
    config = make_config(redis_server)
    assert PrefixRouter.from_config(config).route_prefill("r", prompt(0)).reason is PlacementReason.NO_WORKERS
    unreachable = config.model_copy(update={"redis": config.redis.model_copy(update={"url": "redis://127.0.0.1:1"})})
    router = PrefixRouter.from_config(unreachable)
    assert router.route_prefill("r", prompt(0)).reason is PlacementReason.NO_WORKERS
    assert router.metrics()["redis_available"] == 0 and router.metrics()["redis_errors"] == 1


def test_workers_with_another_block_size_are_skipped(config):
    index = make_index(config)
    for name, block_size in (("ok", 4), ("odd", 8)):
        info = make_info(name, block_size=block_size)
        index.heartbeat(info, WorkerLoad(), 60.0)
    router = PrefixRouter.from_config(config)
    placement = router.route_prefill("r", prompt(0))
    assert [w.split("@")[0] for w in placement.worker_ids] == ["ok"]
    router.route_prefill("r2", prompt(1))
    assert router.metrics()["workers_skipped"] == 1  # counted (and logged) once


def test_decode_placement_spreads_a_burst_by_load(config, workers):
    # A load report resets its worker's pending count (the report includes what was placed on
    # it; these model-free workers report none): none may fall inside the burst, as one every
    # 50 ms did on a slow CI machine.
    config = config.model_copy(
        update={"worker": config.worker.model_copy(update={"load_report_interval_s": 30.0, "heartbeat_ttl_s": 60.0})}
    )
    for name in ("d0", "d1", "d2"):
        workers.start(config, name, role=Role.DECODE, num_blocks=64)
    colocated, _ = workers.start(config, "both", role=Role.COLOCATED, num_blocks=64)
    wait_until(lambda: len(make_index(config).query("decode", [])) == 4)
    router = PrefixRouter.from_config(config)
    chosen = Counter(router.route_decode(f"d-{i}", 20).worker_ids[0] for i in range(8))
    assert len(chosen) == 4 and max(chosen.values()) == 2  # pending placements count as load
    assert router.metrics()["decisions_decode_load"] == 8
    assert [v.worker_id for v in make_index(config).query("prefill", [])] == [colocated.info.worker_id]


def test_bad_inputs_are_refused_before_any_redis_call(config):
    router = PrefixRouter.from_config(config)
    with pytest.raises(ValueError, match="do not match"):
        router.route_prefill_hashes("r", 40, [b"x" * 16])
    with pytest.raises(ValueError, match="at least one token"):
        router.route_decode("r", 0)
    with pytest.raises(ValueError, match="at least one token"):
        router.route_prefill("r", [])
    assert router.metrics()["redis_errors"] == 0


def test_workers_at_addresses_that_left_serve_are_retired_from_every_routers_ranking(config, workers):
    """What a gateway's request router does when Serve's replica set loses a replica (a
    drain or a death): the worker at that address leaves the index now, for this router and
    for one that never saw it, and its agent stands down instead of registering again."""
    started = warm(config, workers, "a", "b")
    router = PrefixRouter.from_config(config)  # knows no worker yet: retire_at looks them up
    assert router.route_prefill("r1", prompt(1)).worker_ids[0] == started["a"][0].info.worker_id
    assert router.retire_at({"replica-a", "replica-gone"}) == [started["a"][0].info.worker_id]
    placement = router.route_prefill("r2", prompt(2))
    assert placement.worker_ids == [started["b"][0].info.worker_id]
    assert placement.reason is not PlacementReason.PREFIX  # a's prefix went with it
    other = PrefixRouter.from_config(config)
    assert other.route_prefill("r3", prompt(3)).worker_ids == [started["b"][0].info.worker_id]
    wait_until(lambda: started["a"][0].is_retired, what="a's agent to stand down")
    assert router.retire_at(set()) == [] and router.retire_at({"replica-gone"}) == []
