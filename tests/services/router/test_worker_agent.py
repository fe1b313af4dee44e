"""The worker side against a real Redis: events land, and every kind of loss heals by snapshot."""

from __future__ import annotations

import threading
import time

from baton.services.router import RouterConfig, WorkerAgent, WorkerConfig, WorkerLoad
from testlib.cache_worker import CacheOnlyEngine
from testlib.losing_publisher import LosingPublisher
from testlib.router_setup import make_config, make_index, make_info
from testlib.waiting import wait_until

PROMPT = list(range(100, 140))  # ten blocks of four


def in_sync(index, agent: WorkerAgent, engine: CacheOnlyEngine) -> bool:
    return index.cached_blocks(agent.info.worker_id) == engine.cached_block_hashes()


def test_registration_load_and_events_land(config, workers):
    agent, engine = workers.start(config, "a", num_blocks=64)
    index = make_index(config)
    wait_until(lambda: agent.counters.num_snapshots_sent, what="the first (empty) snapshot")
    engine.prefill(PROMPT)
    wait_until(lambda: len(index.cached_blocks(agent.info.worker_id)) == 10, what="stored events in Redis")
    assert in_sync(index, agent, engine)
    (view,) = index.query("prefill", [])
    assert view.worker_id == agent.info.worker_id and view.load == WorkerLoad(0, 0, 0, 64, 64)
    assert index.worker_infos([view.worker_id])[view.worker_id].address == "replica-a"
    engine.extra_load = WorkerLoad(num_running=3)
    wait_until(lambda: index.query("prefill", [])[0].load.num_running == 3, what="a fresh load report")
    metrics = agent.metrics()
    assert metrics["redis_available"] == 1 and metrics["events_sent"] >= 1 and metrics["snapshots_sent"] == 1


def test_a_lost_event_triggers_a_snapshot_that_restores_the_index_exactly(config):
    agent = WorkerAgent.from_config(config, make_info("a"))
    losing = LosingPublisher(agent.publisher)
    engine = CacheOnlyEngine(losing, num_blocks=24, block_size=config.block_size)
    agent.start(engine.stats)
    index = make_index(config)
    try:
        engine.prefill(PROMPT)
        wait_until(lambda: in_sync(index, agent, engine), what="the first prompt's blocks")
        losing.lose_next = True
        engine.prefill(list(range(500, 540)))  # evicts part of PROMPT: stored + removed, both lost
        engine.tick()
        assert not in_sync(index, agent, engine)  # the index missed them
        engine.prefill(list(range(900, 912)))  # the next batch has a gap in its sequence
        wait_until(lambda: agent.counters.resyncs["gap"] >= 1, what="the gap to be noticed")
        wait_until(lambda: in_sync(index, agent, engine), what="the snapshot to restore the index")
    finally:
        engine.close()
        agent.close()


def stall_redis(server, seconds: float) -> None:
    """Keeps the server busy (a script spinning on TIME), like a slow or overloaded Redis."""
    spin = "local s = redis.call('TIME') repeat local t = redis.call('TIME') until (t[1] - s[1]) * 1e6 + t[2] - s[2] > tonumber(ARGV[1])"
    with server.client() as client:
        client.eval(spin, 0, int(seconds * 1e6))


def test_buffer_overflow_while_redis_stalls_heals_by_snapshot(redis_server):
    base = make_config(redis_server)
    config = base.model_copy(update={"worker": base.worker.model_copy(update={"max_queued_events": 3})})
    agent = WorkerAgent.from_config(config, make_info("a"))
    engine = CacheOnlyEngine(agent.publisher, num_blocks=64, block_size=config.block_size)
    agent.start(engine.stats)
    index = make_index(config)
    try:
        wait_until(lambda: agent.counters.num_snapshots_sent >= 1, what="the first snapshot")
        stall = threading.Thread(target=stall_redis, args=(redis_server, 0.5))
        stall.start()
        time.sleep(0.05)
        started = time.monotonic()
        for i in range(8):
            engine.prefill(list(range(1000 * i, 1000 * i + 8)))
            engine.tick()  # the engine thread's publish: must not wait for the stalled Redis
        assert time.monotonic() - started < 0.2
        stall.join()
        assert agent.publisher.counters.num_overflows >= 1
        wait_until(lambda: in_sync(index, agent, engine), what="the snapshot after the overflow")
    finally:
        engine.close()
        agent.close()


def test_redis_restart_is_healed_by_reregistration_and_a_snapshot(own_redis, workers):
    config = make_config(own_redis)
    agent, engine = workers.start(config, "a")
    index = make_index(config)
    engine.prefill(PROMPT)
    wait_until(lambda: in_sync(index, agent, engine), what="events before the outage")
    own_redis.kill()
    engine.prefill(list(range(300, 340)))  # while Redis is gone: discarded, covered later
    wait_until(lambda: not agent.availability.is_available, what="the agent to notice the outage")
    own_redis.start()
    wait_until(lambda: in_sync(index, agent, engine), timeout_s=10, what="the snapshot after the restart")
    assert len(index.cached_blocks(agent.info.worker_id)) == 20
    metrics = agent.metrics()
    assert metrics["redis_available"] == 1 and metrics["registrations"] >= 2 and metrics["redis_errors"] >= 1


def test_a_worker_collected_while_alive_registers_again_and_resyncs(config, workers):
    agent, engine = workers.start(config, "a")
    index = make_index(config)
    engine.prefill(PROMPT)
    wait_until(lambda: in_sync(index, agent, engine), what="events")
    index.deregister(agent.info.worker_id)  # what garbage collection does after a long stall
    wait_until(lambda: agent.counters.num_registrations >= 2, what="a new registration")
    wait_until(lambda: in_sync(index, agent, engine) and index.cached_blocks(agent.info.worker_id), what="resync")


def test_an_older_epoch_stops_reporting_once_a_newer_one_registers(config, workers):
    old, _ = workers.start(config, "a", epoch="0" * 23 + "1")
    index = make_index(config)
    wait_until(lambda: index.query("prefill", []), what="the old epoch")
    new, _ = workers.start(config, "a", epoch="0" * 23 + "2")
    wait_until(lambda: old.is_superseded, what="the old epoch to stand down")
    time.sleep(0.2)
    assert [v.worker_id for v in index.query("prefill", [])] == [new.info.worker_id]
    assert old.metrics()["superseded"] == 1


def test_a_retired_worker_stops_reporting_and_stays_out(config, workers):
    """What a router does when Serve drains the worker's replica: out of the ranking at once,
    and its heartbeats, events and the snapshot they would ask for cannot bring it back."""
    agent, engine = workers.start(config, "a")
    index = make_index(config)
    engine.prefill(PROMPT)
    wait_until(lambda: in_sync(index, agent, engine), what="events")
    index.retire(agent.info.worker_id, 60.0)
    assert index.query("prefill", []) == []
    engine.prefill(list(range(300, 340)))  # the draining replica keeps serving its streams
    wait_until(lambda: agent.is_retired, what="the agent to stand down")
    time.sleep(0.3)
    assert index.query("prefill", []) == [] and index.cached_blocks(agent.info.worker_id) == set()
    assert agent.metrics()["retired"] == 1 and agent.counters.num_registrations == 1


def test_a_worker_that_outlives_its_tombstone_registers_again_with_its_blocks(config, workers):
    """A replica retired by mistake (alive, still in Serve's set) is back once the tombstone
    expires: the agent kept heartbeating, and the registration resyncs its blocks."""
    agent, engine = workers.start(config, "a")
    index = make_index(config)
    engine.prefill(PROMPT)
    wait_until(lambda: in_sync(index, agent, engine), what="events")
    index.retire(agent.info.worker_id, 1.0)
    wait_until(lambda: agent.is_retired, what="the agent to stand down")
    wait_until(lambda: agent.counters.num_registrations >= 2, timeout_s=10, what="a registration after the tombstone")
    wait_until(lambda: in_sync(index, agent, engine) and index.cached_blocks(agent.info.worker_id), what="resync")
    assert not agent.is_retired


def test_close_deregisters_and_a_crash_expires(config, workers):
    index = make_index(config)
    clean, _ = workers.start(config, "clean")
    crashed, _ = workers.start(config, "crashed")
    wait_until(lambda: len(index.query("prefill", [])) == 2, what="both workers")
    clean.close()
    crashed.close(deregister=False)
    assert [v.worker_id for v in index.query("prefill", [])] == [crashed.info.worker_id]
    wait_until(lambda: not index.query("prefill", []), timeout_s=3, what="the heartbeat TTL to lapse")
    assert index.collect_garbage() == 1


def test_a_worker_whose_engine_fails_looks_dead(config):
    agent = WorkerAgent.from_config(config, make_info("a"))
    index = make_index(config)
    healthy = True

    def load():
        if not healthy:
            raise RuntimeError("engine died")
        return WorkerLoad()

    agent.start(load)
    try:
        wait_until(lambda: index.query("prefill", []), what="registration")
        healthy = False
        wait_until(lambda: not index.query("prefill", []), timeout_s=3, what="the worker to expire")
    finally:
        agent.close()


def test_the_worker_and_router_configs_must_agree(config):
    info = make_info("a", block_size=8)
    try:
        WorkerAgent.from_config(config, info)
    except ValueError as e:
        assert "block_size 8" in str(e)
    else:
        raise AssertionError("a block size mismatch must be refused")
    assert isinstance(RouterConfig(model="m").worker, WorkerConfig)
