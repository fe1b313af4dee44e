"""After a Redis outage the index is rebuilt from the workers, and no stale owner is used.

Real redis-servers killed by PID, real worker agents over the engine's real KV-cache manager
(CacheOnlyEngine). With `baton serve`'s supervised LocalRedis and the production intervals,
each repeated prefix is placed on its holder again well within 10 s of the kill; with an
outage long enough for workers to crash or restart meanwhile, what comes back is only what
is alive now, in its current epoch."""

from __future__ import annotations

import os
import signal
import time

import pytest
from baton.services.launcher.local_redis import LocalRedis
from baton.services.router import PlacementReason, PrefixRouter, RedisConfig, RouterConfig
from testlib.router_setup import BLOCK_SIZE, MODEL, make_config, make_index
from testlib.waiting import wait_until

REBUILD_LIMIT_S = 10.0
PREFIX_A = list(range(1000, 1064))  # 16 blocks of 4 tokens
PREFIX_B = list(range(3000, 3064))
PREFIX_C = list(range(5000, 5064))


def prompt(prefix: list[int], i: int) -> list[int]:
    return prefix + [90_000 + i, 91_000 + i, 92_000 + i]


def rank(router: PrefixRouter, tokens: list[int]):
    """A placement that writes nothing (no speculative entries), to watch the index alone."""
    hashes = router.hasher.block_hashes(tokens)
    return router.route_prefill_hashes("probe", len(tokens), hashes, record=False)


def placed_on_holder(router: PrefixRouter, tokens: list[int], holder_id: str) -> bool:
    placement = rank(router, tokens)
    return placement.reason is PlacementReason.PREFIX and placement.worker_ids[0] == holder_id


def resynced(metrics: dict) -> dict | None:
    """The agent's metrics once it has registered again and sent its snapshot since."""
    return metrics if metrics["registrations"] >= 2 and metrics["snapshots_sent"] >= 2 else None


def in_sync(index, agent, engine) -> bool:
    return index.cached_blocks(agent.info.worker_id) == engine.cached_block_hashes()


@pytest.fixture
def local_redis(tmp_path):
    server = LocalRedis(tmp_path / "redis")
    yield server
    server.stop()


def test_the_supervised_redis_killed_comes_back_and_prefix_placement_resumes_within_10s(local_redis, workers):
    config = RouterConfig(model=MODEL, block_size=BLOCK_SIZE, redis=RedisConfig(url=local_redis.url))  # defaults
    started = {name: workers.start(config, name) for name in ("a", "b")}
    (agent_a, engine_a), (agent_b, engine_b) = started["a"], started["b"]
    engine_a.prefill(PREFIX_A)
    engine_b.prefill(PREFIX_B)
    index = make_index(config)
    for agent, engine in started.values():
        wait_until(lambda a=agent, e=engine: in_sync(index, a, e) and a.counters.num_snapshots_sent, what="sync")
    router = PrefixRouter.from_config(config)
    a_id, b_id = agent_a.info.worker_id, agent_b.info.worker_id
    assert placed_on_holder(router, prompt(PREFIX_A, 0), a_id) and placed_on_holder(router, prompt(PREFIX_B, 0), b_id)

    pid = local_redis.pid
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: local_redis.num_restarts == 1, timeout_s=5, interval_s=0.005, what="the restart")
    restarted_s = time.monotonic() - killed_at

    def both_placed_on_their_holders() -> bool:
        return placed_on_holder(router, prompt(PREFIX_A, 1), a_id) and placed_on_holder(
            router, prompt(PREFIX_B, 1), b_id
        )

    wait_until(both_placed_on_their_holders, timeout_s=REBUILD_LIMIT_S, interval_s=0.02, what="prefix placement")
    rebuilt_s = time.monotonic() - killed_at
    print(f"Redis restarted {restarted_s * 1000:.0f} ms after the kill; prefix placement back after {rebuilt_s:.2f} s")
    assert rebuilt_s < REBUILD_LIMIT_S
    assert in_sync(index, agent_a, engine_a) and in_sync(index, agent_b, engine_b)  # rebuilt exactly
    for agent in (agent_a, agent_b):  # each counts its snapshot just after Redis has it: wait for that
        metrics = wait_until(lambda a=agent: resynced(a.metrics()), timeout_s=5, what=f"{agent.info.name}'s counters")
        assert metrics["registrations"] == 2, metrics
    # A real placement now: recorded in the restarted Redis, and the next one sees it.
    assert router.route_prefill("after", prompt(PREFIX_A, 2)).worker_ids[0] == a_id
    metrics = router.metrics()
    assert metrics["redis_available"] == 1
    assert "decisions_prefill_fallback" not in metrics  # the closed connection was retried at once


def test_after_a_long_outage_only_live_workers_in_their_current_epoch_are_used(own_redis, workers):
    config = make_config(own_redis)
    names = ("a", "b", "c")
    started = {name: workers.start(config, name) for name in names}
    for name, prefix in zip(names, (PREFIX_A, PREFIX_B, PREFIX_C)):
        started[name][1].prefill(prefix)
    index = make_index(config)
    for agent, engine in started.values():
        wait_until(lambda a=agent, e=engine: in_sync(index, a, e) and a.counters.num_snapshots_sent, what="sync")
    router = PrefixRouter.from_config(config)
    ids = {name: agent.info.worker_id for name, (agent, _) in started.items()}
    for name, prefix in zip(names, (PREFIX_A, PREFIX_B, PREFIX_C)):
        assert placed_on_holder(router, prompt(prefix, 0), ids[name])

    own_redis.kill()  # SIGKILL to the test's own server
    for name in ("b", "c"):  # b crashes; c crashes and comes back as a new epoch, empty
        agent, engine = started[name]
        engine.close()
        agent.close(deregister=False)
    new_c, _ = workers.start(config, "c")
    for _ in range(5):
        assert rank(router, prompt(PREFIX_B, 0)).reason is PlacementReason.FALLBACK  # by load, no prefix credit
    own_redis.start()  # empty

    wait_until(lambda: placed_on_holder(router, prompt(PREFIX_A, 1), ids["a"]), timeout_s=REBUILD_LIMIT_S,
               what="a's prefix to be placed on a again")  # fmt: skip
    wait_until(lambda: new_c.counters.num_snapshots_sent, what="the new epoch of c to publish")
    stale = {ids["b"], ids["c"]}
    deadline = time.monotonic() + 2 * config.worker.heartbeat_ttl_s  # stale ids never come back
    while time.monotonic() < deadline:
        for prefix in (PREFIX_A, PREFIX_B, PREFIX_C):
            placement = rank(router, prompt(prefix, 2))
            assert not stale & set(placement.worker_ids), placement
            assert set(placement.worker_ids) == {ids["a"], new_c.info.worker_id}
        # b's and old c's prefixes are held by no live worker: placed by load, nobody credited
        for prefix in (PREFIX_B, PREFIX_C):
            placement = rank(router, prompt(prefix, 2))
            assert placement.reason is PlacementReason.LOAD and placement.best.num_cached_blocks == 0, placement
        time.sleep(0.05)
    assert index.worker_infos(stale) == {}
