"""Building blocks for router tests and benchmarks: configs, indexes and model-free workers."""

from __future__ import annotations

import itertools

from baton.services.roles import Role
from baton.services.router import (
    Keyspace,
    RedisConfig,
    RedisPrefixIndex,
    RouterConfig,
    WorkerAgent,
    WorkerConfig,
    WorkerInfo,
    create_redis_client,
    new_epoch,
)

from testlib.cache_worker import CacheOnlyEngine
from testlib.redis_server import RedisServer

MODEL = "tiny"
BLOCK_SIZE = 4


def make_config(server: RedisServer, block_size: int = BLOCK_SIZE, **policy) -> RouterConfig:
    """Short TTLs and retry intervals, so expiry and recovery happen within a test."""
    return RouterConfig(
        model=MODEL,
        block_size=block_size,
        redis=RedisConfig(url=server.url, retry_interval_s=0.1),
        worker=WorkerConfig(heartbeat_ttl_s=1.0, load_report_interval_s=0.05, reconnect_interval_s=0.05),
        policy=policy,
    )


def make_index(config: RouterConfig, clock=None, **kwargs) -> RedisPrefixIndex:
    client = create_redis_client(config.redis, socket_timeout_s=5.0)
    keys = Keyspace(config.redis.key_prefix, config.model)
    return RedisPrefixIndex(client, keys, config.index, clock=clock, **kwargs)


def make_info(name: str, role: Role = Role.PREFILL, epoch: str | None = None, **fields) -> WorkerInfo:
    values = {"model": MODEL, "block_size": BLOCK_SIZE, "tp_size": 1, "address": f"replica-{name}"} | fields
    return WorkerInfo(name, epoch or new_epoch(), role, **values)


class Workers:
    """Starts agents, each fed by a CacheOnlyEngine; `close_all` stops whatever is left."""

    def __init__(self) -> None:
        self.running: list[tuple[WorkerAgent, CacheOnlyEngine]] = []
        self._names = itertools.count()

    def start(
        self,
        config: RouterConfig,
        name: str | None = None,
        role: Role = Role.PREFILL,
        num_blocks: int = 256,
        epoch: str | None = None,
        **info,
    ) -> tuple[WorkerAgent, CacheOnlyEngine]:
        worker_info = make_info(name or f"w{next(self._names)}", role, epoch, block_size=config.block_size, **info)
        agent = WorkerAgent.from_config(config, worker_info)
        engine = CacheOnlyEngine(agent.publisher, num_blocks=num_blocks, block_size=config.block_size)
        agent.start(engine.stats)
        self.running.append((agent, engine))
        return agent, engine

    def close_all(self) -> None:
        for agent, engine in self.running:
            engine.close()
            agent.close()
