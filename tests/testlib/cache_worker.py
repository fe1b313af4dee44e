"""A worker's prefix cache without a model: the engine's real KV-cache manager and its events.

`CacheOnlyEngine` keeps the engine's side of the `KVEventPublisher` contract the way
`AsyncLLM` does: a thread ticks (every `tick_s`), hands the pool's new events to the
publisher and answers `wants_snapshot()` with a snapshot, all from that one thread.
`prefill(tokens)` runs a prompt through the cache exactly as the scheduler would (prefix
hit, allocate, register full blocks, free), so events and evictions are the real ones.
"""

from __future__ import annotations

import itertools
import threading

from baton.services.engine.api.sampling_params import SamplingParams
from baton.services.engine.core.block_hash import request_extra_keys
from baton.services.engine.core.kv_cache_manager import KVCacheManager
from baton.services.engine.core.kv_events import KVEventPublisher
from baton.services.engine.core.request import Request
from baton.services.router import WorkerLoad


class CacheOnlyEngine:
    def __init__(self, publisher: KVEventPublisher, num_blocks: int = 256, block_size: int = 4, tick_s=0.01) -> None:
        self.publisher = publisher
        self.kv = KVCacheManager(block_size, num_blocks)
        self.block_size = block_size
        self.tick_s = tick_s
        self.extra_load = WorkerLoad()  # what stats() adds: tests make a worker look busy
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cache-only-engine", daemon=True)
        self._thread.start()

    def prefill(self, token_ids: list[int], cache_salt: str | None = None) -> int:
        """Runs one prompt through the prefix cache; returns how many tokens were cache hits."""
        with self._lock:
            request = Request(
                f"r{next(self._ids)}",
                list(token_ids),
                SamplingParams(),
                frozenset(),
                max_tokens=1,
                extra_keys=request_extra_keys(cache_salt),
            )
            hits, num_hit_tokens = self.kv.get_computed_blocks(request)
            if self.kv.allocate_slots(request, len(token_ids) - num_hit_tokens, hits) is None:
                raise RuntimeError("the prompt does not fit in the KV cache")
            self.kv.free(request)
            return num_hit_tokens

    def cached_block_hashes(self) -> set[bytes]:
        with self._lock:
            return self.kv.pool.cached_block_hashes()

    def stats(self) -> WorkerLoad:
        extra = self.extra_load
        return WorkerLoad(
            extra.num_running,
            extra.num_waiting,
            extra.num_waiting_prefill_tokens,
            self.kv.num_free_blocks,
            self.kv.pool.num_blocks,
        )

    def tick(self) -> None:
        with self._lock:
            events = self.kv.pool.take_events()
            if events:
                self.publisher.publish(events)
            if self.publisher.wants_snapshot():
                self.publisher.publish_snapshot(self.kv.pool.snapshot())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            self.tick()
