"""The prefix index in one process's memory: the model `RedisPrefixIndex` is tested against.

It follows the Lua scripts rule for rule (lua_scripts.py) so that a property test can
replay one random event stream into both and compare; it also serves single-process
simulations and policy tests that need no Redis.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ..engine.core.block_hash import BlockHash
from ..engine.core.kv_events import AllBlocksCleared, BlockStored, KVCacheSnapshot, KVEvent
from .config import IndexConfig
from .prefix_index import (
    ApplyResult,
    ApplyStatus,
    Clock,
    HeartbeatResult,
    PrefixIndex,
    WorkerView,
    cached_run,
    check_role,
    checkpoint_positions,
    checkpoints_beyond,
)
from .worker_info import WorkerInfo, WorkerLoad


@dataclass(slots=True)
class _Worker:
    info: WorkerInfo
    load: WorkerLoad = WorkerLoad()
    reported_at_ms: int = 0
    alive_until_ms: int = 0
    next_seq: int | None = None  # None: no sequence yet (a snapshot must come first)
    blocks: set[BlockHash] = field(default_factory=set)
    speculative: dict[BlockHash, int] = field(default_factory=dict)  # checkpoint hash -> expiry ms
    num_pending_requests: int = 0  # placements since the last load report
    num_pending_tokens: int = 0
    pending_until_ms: int = 0  # they stop counting then


def _wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


class InMemoryPrefixIndex(PrefixIndex):
    def __init__(self, config: IndexConfig | None = None, clock: Clock | None = None) -> None:
        self.config = config or IndexConfig()
        self._clock = clock or _wall_clock_ms
        self._workers: dict[str, _Worker] = {}
        self._names: dict[str, str] = {}  # name -> current epoch
        self._retired_until_ms: dict[str, int] = {}  # worker id -> when its tombstone expires

    # -- worker side ------------------------------------------------------------------

    def heartbeat(self, info: WorkerInfo, load: WorkerLoad, ttl_s: float) -> HeartbeatResult:
        if self._retired_until_ms.get(info.worker_id, -1) > self._clock():
            return HeartbeatResult.RETIRED
        current = self._names.get(info.name)
        if current is not None and current > info.epoch:
            return HeartbeatResult.SUPERSEDED
        result = HeartbeatResult.REFRESHED
        if current != info.epoch or info.worker_id not in self._workers:
            if current is not None and current != info.epoch:
                self.deregister(f"{info.name}@{current}")
            self._names[info.name] = info.epoch
            self._workers[info.worker_id] = _Worker(info)
            result = HeartbeatResult.REGISTERED
        worker = self._workers[info.worker_id]
        now = self._clock()
        worker.load, worker.reported_at_ms, worker.alive_until_ms = load, now, now + int(ttl_s * 1000)
        worker.num_pending_requests = worker.num_pending_tokens = worker.pending_until_ms = 0
        return result

    def deregister(self, worker_id: str) -> None:
        worker = self._workers.pop(worker_id, None)
        if worker is not None and self._names.get(worker.info.name) == worker.info.epoch:
            del self._names[worker.info.name]

    def retire(self, worker_id: str, ttl_s: float) -> None:
        self.deregister(worker_id)
        now = self._clock()
        self._retired_until_ms = {w: t for w, t in self._retired_until_ms.items() if t > now}
        self._retired_until_ms[worker_id] = now + max(1, int(ttl_s * 1000))

    def apply_events(self, worker_id: str, events: Sequence[KVEvent]) -> ApplyResult:
        worker = self._workers.get(worker_id)
        if worker is None:
            return ApplyResult(ApplyStatus.UNREGISTERED, -1)
        if worker.next_seq is None:
            return ApplyResult(ApplyStatus.MISSING, -1)
        status = ApplyStatus.OK
        for event in events:
            if event.seq > worker.next_seq:
                status = ApplyStatus.GAP
                break
            if event.seq < worker.next_seq:
                continue  # applied already
            self._apply(worker, event)
            worker.next_seq += 1
        return ApplyResult(status, worker.next_seq)

    def replace_blocks(self, worker_id: str, snapshot: KVCacheSnapshot) -> bool:
        worker = self._workers.get(worker_id)
        if worker is None:
            return False
        worker.blocks = set(snapshot.block_hashes)
        worker.speculative.clear()  # a snapshot starts the worker's entries afresh
        worker.next_seq = snapshot.next_seq
        return True

    # -- router side ------------------------------------------------------------------

    def query(self, role: str, block_hashes: Sequence[BlockHash]) -> list[WorkerView]:
        check_role(role)
        now = self._clock()
        views = []
        for worker_id in sorted(self._workers):
            worker = self._workers[worker_id]
            if role not in worker.info.role.index_roles or not self._is_alive(worker, now):
                continue
            counts = worker.pending_until_ms > now
            views.append(
                WorkerView(
                    worker_id,
                    worker.load,
                    worker.reported_at_ms,
                    self._prefix_length(worker, block_hashes, now),
                    worker.num_pending_requests if counts else 0,
                    worker.num_pending_tokens if counts else 0,
                    len(worker.blocks),
                )
            )
        return views

    def record_placement(
        self, worker_id: str, block_hashes: Sequence[BlockHash], num_new_tokens: int, num_cached_blocks: int = 0
    ) -> None:
        worker = self._workers.get(worker_id)
        now = self._clock()
        if worker is None or not self._is_alive(worker, now):
            return
        spec_ttl_ms = int(self.config.speculative_ttl_s * 1000)
        if spec_ttl_ms > 0 and block_hashes:
            for position in checkpoints_beyond(len(block_hashes), num_cached_blocks):  # ZADD GT: expiries only grow
                block_hash = block_hashes[position - 1]
                worker.speculative[block_hash] = max(worker.speculative.get(block_hash, 0), now + spec_ttl_ms)
            worker.speculative = {h: t for h, t in worker.speculative.items() if t > now}
        if worker.pending_until_ms <= now:
            worker.num_pending_requests = worker.num_pending_tokens = 0
        worker.num_pending_requests += 1
        worker.num_pending_tokens += num_new_tokens
        worker.pending_until_ms = now + int(self.config.pending_ttl_s * 1000)

    def complete_placement(self, worker_id: str, num_new_tokens: int) -> None:
        worker = self._workers.get(worker_id)
        if worker is None or worker.pending_until_ms <= self._clock():
            return
        worker.num_pending_requests = max(worker.num_pending_requests - 1, 0)
        worker.num_pending_tokens = max(worker.num_pending_tokens - num_new_tokens, 0)

    def worker_infos(self, worker_ids: Iterable[str]) -> dict[str, WorkerInfo]:
        return {w: self._workers[w].info for w in worker_ids if w in self._workers}

    def collect_garbage(self) -> int:
        now = self._clock()
        dead = [w for w, worker in self._workers.items() if not self._is_alive(worker, now)]
        for worker_id in dead:
            self.deregister(worker_id)
        return len(dead)

    def cached_blocks(self, worker_id: str) -> set[BlockHash]:
        worker = self._workers.get(worker_id)
        return set(worker.blocks) if worker is not None else set()

    # -- internals --------------------------------------------------------------------

    @staticmethod
    def _apply(worker: _Worker, event: KVEvent) -> None:
        if isinstance(event, AllBlocksCleared):
            worker.blocks.clear()
            worker.speculative.clear()
            return
        if isinstance(event, BlockStored):
            worker.blocks.update(event.block_hashes)
            return
        worker.blocks.difference_update(event.block_hashes)
        for block_hash in event.block_hashes:  # evicted: no longer a prediction either
            worker.speculative.pop(block_hash, None)

    @staticmethod
    def _is_alive(worker: _Worker, now: int) -> bool:
        return worker.alive_until_ms > now

    @staticmethod
    def _prefix_length(worker: _Worker, block_hashes: Sequence[BlockHash], now: int) -> int:
        """The cached run, then the live speculative checkpoints that continue it (prefix_index.py)."""
        length = cached_run(len(block_hashes), lambda position: block_hashes[position - 1] in worker.blocks)
        for position in checkpoint_positions(len(block_hashes)):
            if position <= length:
                continue
            if worker.speculative.get(block_hashes[position - 1], 0) <= now:
                break
            length = position
        return length
