"""The prefix index in Redis, shared by every router and worker of one model.

Each method is one round trip: a Lua script (lua_scripts.py for the worker side,
lua_routing.py for the routing path) for anything that reads and writes, a pipeline for a
snapshot upload. The key layout is in keys.py. Redis errors (`redis.RedisError`) reach the
caller, which decides what unavailability means: the router routes by load, the worker
agent retries and then republishes a snapshot.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from operator import attrgetter

import redis

from ..engine.core.block_hash import BlockHash
from ..engine.core.kv_events import BlockRemoved, BlockStored, KVCacheSnapshot, KVEvent
from . import lua_routing, lua_scripts
from .config import IndexConfig, WorkerConfig
from .keys import Keyspace
from .prefix_index import (
    ApplyResult,
    ApplyStatus,
    Clock,
    HeartbeatResult,
    PrefixIndex,
    WorkerView,
    check_role,
    checkpoints_beyond,
)
from .script_channel import ScriptChannel
from .worker_info import WorkerInfo, WorkerLoad

_SNAPSHOT_CHUNK = WorkerConfig.model_fields["snapshot_chunk_size"].default
_worker_id = attrgetter("worker_id")


class RedisPrefixIndex(PrefixIndex):
    def __init__(
        self,
        client: redis.Redis,
        keys: Keyspace,
        config: IndexConfig | None = None,
        clock: Clock | None = None,
        snapshot_chunk_size: int = _SNAPSHOT_CHUNK,
    ) -> None:
        self.client = client
        self.keys = keys
        self.config = config or IndexConfig()
        self._clock = clock
        self._snapshot_chunk_size = snapshot_chunk_size
        self._reports: dict[str, tuple[int, WorkerLoad]] = {}
        self._spec_ttl_ms = int(self.config.speculative_ttl_s * 1000)
        self._pending_ttl_ms = int(self.config.pending_ttl_s * 1000)
        register = client.register_script
        self._heartbeat = register(lua_scripts.HEARTBEAT)
        self._deregister = register(lua_scripts.DEREGISTER)
        self._retire = register(lua_scripts.RETIRE)
        self._apply_events = register(lua_scripts.APPLY_EVENTS)
        self._commit_snapshot = register(lua_scripts.COMMIT_SNAPSHOT)
        self._collect_garbage = register(lua_scripts.COLLECT_GARBAGE)
        # The routing path: the query waits, the placement write does not. Each thread gets
        # its own channel (connection), so decisions on several threads overlap their round
        # trips, as they do when Serve's router runs them with asyncio.to_thread.
        self._routing_scripts = [lua_routing.QUERY, lua_routing.RECORD_PLACEMENT, lua_routing.COMPLETE_PLACEMENT]
        self._thread_channel = threading.local()
        self._channels: list[ScriptChannel] = []
        self._channels_lock = threading.Lock()

    # -- worker side ------------------------------------------------------------------

    def heartbeat(self, info: WorkerInfo, load: WorkerLoad, ttl_s: float) -> HeartbeatResult:
        args = [
            self.keys.namespace,
            info.worker_id,
            info.name,
            info.epoch,
            info.to_json(),
            " ".join(info.role.index_roles),
            load.encode(),
            max(1, int(ttl_s * 1000)),
            self._now_ms(),
        ]
        return HeartbeatResult(self._heartbeat(args=args))

    def deregister(self, worker_id: str) -> None:
        self._deregister(args=[self.keys.namespace, worker_id])

    def retire(self, worker_id: str, ttl_s: float) -> None:
        self._retire(args=[self.keys.namespace, worker_id, max(1, int(ttl_s * 1000))])

    def apply_events(self, worker_id: str, events: Sequence[KVEvent]) -> ApplyResult:
        status, next_seq = self._apply_events(args=[self.keys.namespace, worker_id, *encode_events(events)])
        return ApplyResult(ApplyStatus(status.decode()), next_seq)

    def replace_blocks(self, worker_id: str, snapshot: KVCacheSnapshot) -> bool:
        """Uploads into a side key and renames it over the worker's set, all in one pipeline."""
        tmp = self.keys.worker(worker_id, "snapshot")
        hashes = list(snapshot.block_hashes)
        pipe = self.client.pipeline(transaction=False)
        pipe.unlink(tmp)
        for begin in range(0, len(hashes), self._snapshot_chunk_size):
            pipe.sadd(tmp, *hashes[begin : begin + self._snapshot_chunk_size])
        self._commit_snapshot(args=[self.keys.namespace, worker_id, snapshot.next_seq, len(hashes)], client=pipe)
        result = pipe.execute()[-1]
        if result == -2:
            raise redis.RedisError(f"snapshot upload for {worker_id} arrived incomplete")
        return result == 1

    # -- router side ------------------------------------------------------------------

    def query(self, role: str, block_hashes: Sequence[BlockHash]) -> list[WorkerView]:
        first_block = block_hashes[0].hex() if block_hashes else ""
        args = [self.keys.namespace, check_role(role), self._now_ms(), b"".join(block_hashes), first_block]
        fields = iter(self._channel().call(lua_routing.QUERY, args).decode().split())
        server_now, now = int(next(fields)), int(next(fields))
        views = []
        for worker_id, alive_until, report, requests, tokens, until, num_cached, num_stored in zip(*[fields] * 8):
            if int(alive_until) <= server_now:
                continue  # its heartbeat expired; garbage collection will wipe it
            reported_at, load = self._decode_report(report)
            pending = int(until) > now  # else a load report or the pending TTL cleared them
            views.append(
                WorkerView(
                    worker_id,
                    load,
                    reported_at,
                    int(num_cached),
                    int(requests) if pending else 0,
                    int(tokens) if pending else 0,
                    int(num_stored),
                )
            )
        views.sort(key=_worker_id)  # SMEMBERS order differs between servers
        return views

    def record_placement(
        self, worker_id: str, block_hashes: Sequence[BlockHash], num_new_tokens: int, num_cached_blocks: int = 0
    ) -> None:
        args = [
            self.keys.namespace,
            worker_id,
            num_new_tokens,
            self._spec_ttl_ms,
            self._pending_ttl_ms,
            self._now_ms(),
            b"".join([block_hashes[p - 1] for p in checkpoints_beyond(len(block_hashes), num_cached_blocks)]),
            block_hashes[0].hex() if block_hashes else "",
        ]
        self._channel().send(lua_routing.RECORD_PLACEMENT, args)

    def complete_placement(self, worker_id: str, num_new_tokens: int) -> None:
        args = [self.keys.namespace, worker_id, num_new_tokens, self._now_ms()]
        self._channel().send(lua_routing.COMPLETE_PLACEMENT, args)

    def flush(self) -> None:
        """Waits until Redis has applied every placement write (they are sent without waiting)."""
        with self._channels_lock:
            channels = list(self._channels)
        for channel in channels:
            channel.flush()

    def worker_infos(self, worker_ids: Iterable[str]) -> dict[str, WorkerInfo]:
        worker_ids = list(worker_ids)
        if not worker_ids:
            return {}
        entries = self.client.hmget(self.keys.workers, worker_ids)
        return {w: WorkerInfo.from_json(e) for w, e in zip(worker_ids, entries) if e is not None}

    def collect_garbage(self) -> int:
        return self._collect_garbage(args=[self.keys.namespace])

    def cached_blocks(self, worker_id: str) -> set[BlockHash]:
        return set(self.client.smembers(self.keys.worker(worker_id, "cached")))

    # -- internals --------------------------------------------------------------------

    def _decode_report(self, text: str) -> tuple[int, WorkerLoad]:
        """`<reported_at_ms>,<load>`. A report repeats across queries until the next heartbeat:
        decode each text once."""
        report = self._reports.get(text)
        if report is None:
            if len(self._reports) > 4096:
                self._reports.clear()
            reported_at, _, load = text.partition(",")
            report = self._reports[text] = (int(reported_at), WorkerLoad.decode(load))
        return report

    def _channel(self) -> ScriptChannel:
        channel = getattr(self._thread_channel, "channel", None)
        if channel is None:
            channel = self._thread_channel.channel = ScriptChannel(self.client, self._routing_scripts)
            with self._channels_lock:
                self._channels.append(channel)
        return channel

    def _now_ms(self) -> int:
        return -1 if self._clock is None else self._clock()


def encode_events(events: Sequence[KVEvent]) -> list[bytes | str | int]:
    """Flattens events into script arguments: kind, seq, packed hashes."""
    args: list[bytes | str | int] = []
    for event in events:
        if isinstance(event, BlockStored):
            args += ["S", event.seq, b"".join(event.block_hashes)]
        elif isinstance(event, BlockRemoved):
            args += ["R", event.seq, b"".join(event.block_hashes)]
        else:
            args += ["C", event.seq, b""]
    return args
