"""Baton's prefix-aware router: a Redis-backed index of every worker's prefix cache.

Router side (the gateway):
    router = PrefixRouter.from_config(RouterConfig(model="llama", block_size=16))
    placement = router.route_prefill(request_id, prompt_token_ids)   # ranked worker ids + reason

Worker side (each prefill/decode replica):
    agent = WorkerAgent.from_config(config, WorkerInfo(name, new_epoch(), role, ...))
    engine = AsyncLLM(engine_config, kv_event_publisher=agent.publisher)
    agent.start(engine.stats)

Importable without Ray; see README.md for the Ray Serve integration.
"""

from .config import IndexConfig, PolicyConfig, RedisConfig, RouterConfig, WorkerConfig
from .event_buffer import KVEventBuffer
from .in_memory_prefix_index import InMemoryPrefixIndex
from .keys import Keyspace
from .policy import (
    LoadPolicy,
    Placement,
    PlacementReason,
    PrefixAwarePolicy,
    RankedWorker,
    RoutingPolicy,
    RoutingRequest,
)
from .prefix_index import ApplyResult, ApplyStatus, HeartbeatResult, PrefixIndex, WorkerView
from .prompt_hasher import PromptHasher
from .redis_client import create_redis_client
from .redis_prefix_index import RedisPrefixIndex
from .router import PrefixRouter
from .worker_agent import WorkerAgent
from .worker_info import WorkerInfo, WorkerLoad, new_epoch

__all__ = [
    "RouterConfig",
    "RedisConfig",
    "IndexConfig",
    "PolicyConfig",
    "WorkerConfig",
    "PrefixRouter",
    "PromptHasher",
    "WorkerAgent",
    "KVEventBuffer",
    "PrefixIndex",
    "RedisPrefixIndex",
    "InMemoryPrefixIndex",
    "Keyspace",
    "ApplyResult",
    "ApplyStatus",
    "HeartbeatResult",
    "WorkerView",
    "RoutingPolicy",
    "PrefixAwarePolicy",
    "LoadPolicy",
    "RoutingRequest",
    "RankedWorker",
    "Placement",
    "PlacementReason",
    "WorkerInfo",
    "WorkerLoad",
    "new_epoch",
    "create_redis_client",
]
