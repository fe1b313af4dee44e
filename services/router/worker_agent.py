"""The worker side of the router: one thread that keeps this worker current in the index.

    every load_report_interval_s   heartbeat(info, load)        registers, refreshes TTL + load
    whenever events are buffered   replace_blocks(snapshot)     first, if the engine sent one
                                   apply_events(batch)          then events, in batches

The engine only ever touches `agent.publisher` (a KVEventBuffer): it enqueues. This
thread does every Redis round trip, so a slow or dead Redis never stalls a step.

Recovery, all by snapshot: a gap in the sequence, an index that lost this worker's entries
(Redis restarted, or this worker was collected as dead after a stall), or a reconnect after
an outage each make the agent ask the engine for a snapshot of its cached block hashes,
which replaces the worker's entries wholesale. While Redis is unreachable, heartbeats
double as reconnect probes and events are discarded (the snapshot after reconnect covers
them). A new epoch's first heartbeat wipes the entries of the worker's previous life.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from ..engine.core.kv_events import KVCacheSnapshot, KVEvent
from .availability import Availability
from .config import RouterConfig, WorkerConfig
from .event_buffer import KVEventBuffer
from .keys import Keyspace
from .prefix_index import ApplyStatus, HeartbeatResult, PrefixIndex
from .redis_client import create_redis_client
from .redis_prefix_index import RedisPrefixIndex
from .worker_info import WorkerInfo, WorkerLoad

logger = logging.getLogger(__name__)
LoadSource = Callable[[], object]  # returns WorkerLoad or the engine's EngineStats


@dataclass(slots=True)
class AgentCounters:
    num_heartbeats: int = 0
    num_registrations: int = 0
    num_redis_errors: int = 0
    num_events_sent: int = 0
    num_snapshots_sent: int = 0
    resyncs: Counter = field(default_factory=Counter)  # why a snapshot was needed: gap, missing, ...


class WorkerAgent:
    def __init__(self, info: WorkerInfo, index: PrefixIndex, config: WorkerConfig | None = None) -> None:
        self.info = info
        self.index = index
        self.config = config or WorkerConfig()
        self.publisher = KVEventBuffer(self.config.max_queued_events)
        self.availability = Availability(f"worker {info.worker_id}", self.config.reconnect_interval_s)
        self.counters = AgentCounters()
        self.is_superseded = False  # a later epoch of this worker registered: this process stops reporting
        self.is_retired = False  # a router retired it (its replica drains): heartbeats only, until it expires
        self._load_source: LoadSource = WorkerLoad
        self._stop = threading.Event()
        self._heartbeat_now = False
        self._deregister_on_stop = True
        self._thread: threading.Thread | None = None

    @classmethod
    def from_config(cls, config: RouterConfig, info: WorkerInfo) -> WorkerAgent:
        """The agent of a real worker: its own Redis client with the worker's longer timeout."""
        if (info.model, info.block_size) != (config.model, config.block_size):
            raise ValueError(
                f"worker {info.worker_id} serves {info.model!r} with block_size {info.block_size}, "
                f"but the router config says {config.model!r} with block_size {config.block_size}"
            )
        client = create_redis_client(config.redis, socket_timeout_s=config.worker.socket_timeout_s)
        keys = Keyspace(config.redis.key_prefix, config.model)
        index = RedisPrefixIndex(client, keys, config.index, snapshot_chunk_size=config.worker.snapshot_chunk_size)
        return cls(info, index, config.worker)

    def start(self, load_source: LoadSource) -> None:
        """Starts reporting; load_source is called on the agent's thread (AsyncLLM.stats is safe)."""
        if self._thread is not None:
            raise RuntimeError("the worker agent is already started")
        self._load_source = load_source
        self._thread = threading.Thread(target=self._run, name=f"baton-agent-{self.info.name}", daemon=True)
        self._thread.start()

    def close(self, deregister: bool = True) -> None:
        """Stops the thread; deregister=False leaves the entries to expire (what a crash does)."""
        self._deregister_on_stop = deregister
        self._stop.set()
        self.publisher.close()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def metrics(self) -> dict[str, int]:
        buffer, agent = self.publisher.counters, self.counters
        return {
            "redis_available": int(self.availability.is_available),
            "superseded": int(self.is_superseded),
            "retired": int(self.is_retired),
            "heartbeats": agent.num_heartbeats,
            "registrations": agent.num_registrations,
            "redis_errors": agent.num_redis_errors,
            "events_sent": agent.num_events_sent,
            "events_discarded": buffer.num_events_discarded,
            "buffer_overflows": buffer.num_overflows,
            "snapshots_sent": agent.num_snapshots_sent,
            **{f"resyncs_{reason}": n for reason, n in sorted(agent.resyncs.items())},
        }

    # -- the thread -------------------------------------------------------------------

    def _run(self) -> None:
        next_heartbeat = 0.0
        while not self._stop.is_set() and not self.publisher.is_closed:
            if self._heartbeat_now or time.monotonic() >= next_heartbeat:
                self._heartbeat_now = False
                self._heartbeat()
                up = self.availability.is_available
                interval = self.config.load_report_interval_s if up else self.config.reconnect_interval_s
                next_heartbeat = time.monotonic() + interval
            if self.availability.is_available:
                self._drain(next_heartbeat)
            if self._heartbeat_now:
                continue
            timeout = max(0.0, next_heartbeat - time.monotonic())
            if self.availability.is_available:
                self.publisher.wait(timeout)  # wakes early for events and snapshots
            else:
                self._stop.wait(timeout)  # nothing to send until the next reconnect probe
        if self._deregister_on_stop and not (self.is_superseded or self.is_retired):
            try:
                self.index.deregister(self.info.worker_id)
            except redis.RedisError as e:
                logger.warning("worker %s could not deregister: %s", self.info.worker_id, e)

    def _heartbeat(self) -> None:
        try:
            load = self._load_source()
            load = load if isinstance(load, WorkerLoad) else WorkerLoad.from_engine_stats(load)
        except Exception:  # a failing engine must look dead to routers: skip the heartbeat
            logger.exception("worker %s: cannot read its load; skipping the heartbeat", self.info.worker_id)
            return
        try:
            result = self.index.heartbeat(self.info, load, self.config.heartbeat_ttl_s)
        except redis.RedisError as e:
            self._on_redis_error(e)
            return
        self.counters.num_heartbeats += 1
        if self.availability.record_success():
            self._resync("reconnect")
        was_retired, self.is_retired = self.is_retired, result is HeartbeatResult.RETIRED
        if result is HeartbeatResult.REGISTERED:
            self.counters.num_registrations += 1
            self._resync("registered")
        elif result is HeartbeatResult.SUPERSEDED:
            logger.error("worker %s: a later epoch of %s is registered; stopping", self.info.worker_id, self.info.name)
            self.is_superseded = True
            self._stop.set()
        elif result is HeartbeatResult.RETIRED:
            # Draining (or retired by mistake): events wait for the snapshot a later
            # registration asks for; heartbeats go on, so the worker is back if it outlives
            # its tombstone.
            if not was_retired:
                logger.info("worker %s: retired by a router (draining); not reporting events", self.info.worker_id)
            self.publisher.invalidate()

    def _drain(self, deadline: float) -> None:
        """Sends buffered work until the buffer is empty or the next heartbeat is due."""
        while self.publisher.has_work() and time.monotonic() < deadline and not self._stop.is_set():
            snapshot, events = self.publisher.take(self.config.max_events_per_batch)
            try:
                if snapshot is not None and not self._send_snapshot(snapshot):
                    return
                if events and not self._send_events(events):
                    return
            except redis.RedisError as e:
                self._on_redis_error(e)
                return

    def _send_snapshot(self, snapshot: KVCacheSnapshot) -> bool:
        if not self.index.replace_blocks(self.info.worker_id, snapshot):
            self._on_unregistered()
            return False
        self.counters.num_snapshots_sent += 1
        return True

    def _send_events(self, events: list[KVEvent]) -> bool:
        result = self.index.apply_events(self.info.worker_id, events)
        if result.status is ApplyStatus.UNREGISTERED:
            self._on_unregistered()
            return False
        if result.needs_snapshot:
            self._resync(result.status.value)
            return False
        self.counters.num_events_sent += len(events)
        return True

    def _on_unregistered(self) -> None:
        """Collected as dead (a stall longer than the TTL): register again now; that asks for a snapshot."""
        self.counters.resyncs["unregistered"] += 1
        self.publisher.invalidate()
        self._heartbeat_now = True

    def _on_redis_error(self, error: redis.RedisError) -> None:
        self.counters.num_redis_errors += 1
        self.availability.record_failure(error)
        self.publisher.invalidate()

    def _resync(self, reason: str) -> None:
        self.counters.resyncs[reason] += 1
        logger.info("worker %s: republishing a snapshot (%s)", self.info.worker_id, reason)
        self.publisher.request_snapshot()
