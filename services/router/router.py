"""The gateway's router: hash the prompt, query the index once, rank, record the choice.

    placement = router.route_prefill(request_id, prompt_token_ids, cache_salt)
    placement.worker_ids        ranked worker ids, best first (router.worker_info(id).address
                                is how the serving layer reaches each one)
    placement.reason            prefix | load | imbalance | fallback | no_workers

A decision is one index query (every alive worker's load and cached prefix, one Redis
round trip), the policy's ranking, then one write that records speculative entries and
pending load for the chosen worker, so the next request of a burst sees them; the write
is sent without waiting for its reply (script_channel.py). A caller that learns only later
which worker took the request (Serve's request router) ranks with `hold=` instead: the
placement counts in this router's own rankings (held_placements.py) until it `commit`s the
worker that took it, or `release`s it. Beyond those holds a router keeps no routing state
of its own while Redis is up: replicas reading the same Redis decide the same. Calls are
synchronous, thread-safe, and take about a Redis round trip.

Redis unavailable: the decision falls back to load-only ranking over the workers of the
last successful query (their last loads, plus what this router placed since), logs once
and shows in `metrics()`. Redis is tried again every `redis.retry_interval_s`; the first
success ends the fallback, and prefix routing resumes as workers republish snapshots. A
connection that Redis closed (it restarted) is retried once at once, on a fresh one, so a
quick restart costs no fallback at all.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

import redis

from ..engine.core.block_hash import BlockHash
from .availability import Availability
from .config import RouterConfig
from .held_placements import HeldPlacements
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
from .prefix_index import PrefixIndex, WorkerView
from .prompt_hasher import PromptHasher
from .redis_client import create_redis_client
from .redis_prefix_index import RedisPrefixIndex
from .worker_info import WorkerInfo

logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class RouterCounters:
    decisions: Counter = dataclasses.field(default_factory=Counter)  # (role, reason) -> count
    num_redis_errors: int = 0
    num_workers_collected: int = 0
    num_workers_skipped: int = 0  # registered with another block size than this router's
    num_prompt_blocks: int = 0  # full blocks of routed prefill prompts
    num_cached_blocks: int = 0  # of which the chosen worker held (as the index saw it)


# How long a retired worker's heartbeats stay refused: longer than a replica's drain (Helm's
# grace period is 35 s), and short enough that a replica retired by mistake is back soon.
RETIRED_TTL_S = 600.0


class PrefixRouter:
    def __init__(
        self,
        config: RouterConfig,
        index: PrefixIndex,
        prefill_policy: RoutingPolicy | None = None,
        decode_policy: RoutingPolicy | None = None,
        hasher: PromptHasher | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.index = index
        self.prefill_policy = prefill_policy or PrefixAwarePolicy(config.policy)
        self.decode_policy = decode_policy or LoadPolicy()
        self.hasher = hasher or PromptHasher(config.block_size)
        if self.hasher.block_size != config.block_size:
            raise ValueError(f"the hasher's block_size {self.hasher.block_size} is not {config.block_size}")
        self.availability = Availability("router", config.redis.retry_interval_s, clock)
        self.counters = RouterCounters()
        self._clock = clock
        self._infos: dict[str, WorkerInfo] = {}  # immutable per worker id (the id carries the epoch)
        self._usable_ids: set[str] = set()  # known, with this router's block size
        self._last_views: dict[str, list[WorkerView]] = {}  # per role, from the last successful query
        self._outage_requests: Counter = Counter()  # placed per worker while Redis was unavailable
        self._outage_tokens: Counter = Counter()
        self._next_gc = clock() + config.index.gc_interval_s
        self._held = HeldPlacements(config.index.pending_ttl_s, config.index.speculative_ttl_s > 0, clock)
        self._ranking = threading.Lock()  # a ranking and its hold are one step for concurrent callers

    @classmethod
    def from_config(cls, config: RouterConfig, tokenizer=None) -> PrefixRouter:
        client = create_redis_client(config.redis)
        index = RedisPrefixIndex(client, Keyspace(config.redis.key_prefix, config.model), config.index)
        return cls(config, index, hasher=PromptHasher(config.block_size, tokenizer))

    # -- the API ----------------------------------------------------------------------

    def route_prefill(
        self, request_id: str, prompt_token_ids: Sequence[int], cache_salt: str | None = None
    ) -> Placement:
        """Hashes the prompt's full blocks with the engine's function, then places it."""
        block_hashes = self.hasher.block_hashes(prompt_token_ids, cache_salt)
        return self.route_prefill_hashes(request_id, len(prompt_token_ids), block_hashes)

    def route_prefill_hashes(
        self,
        request_id: str,
        num_prompt_tokens: int,
        block_hashes: Sequence[BlockHash],
        record: bool = True,
        hold: str | None = None,
    ) -> Placement:
        """For a caller that hashed the prompt already (PromptHasher.block_hashes).

        `record=False` ranks without recording the placement. With `hold=key` as well, the
        first worker is held under `key` until the caller commits the worker that finally
        took the request (`commit`; Serve may skip the first choice) or releases it."""
        if len(block_hashes) != num_prompt_tokens // self.config.block_size:
            raise ValueError(
                f"{len(block_hashes)} block hashes do not match {num_prompt_tokens} prompt tokens "
                f"at block_size {self.config.block_size}"
            )
        affinity_key = block_hashes[0] if block_hashes else b""
        request = RoutingRequest(request_id, num_prompt_tokens, self.config.block_size, affinity_key)
        placement = self._route("prefill", self.prefill_policy, request, block_hashes, record, hold)
        if placement.best is not None:
            self.counters.num_prompt_blocks += len(block_hashes)
            self.counters.num_cached_blocks += placement.best.num_cached_blocks
        return placement

    def route_decode(
        self, request_id: str, num_prompt_tokens: int, record: bool = True, hold: str | None = None
    ) -> Placement:
        request = RoutingRequest(request_id, num_prompt_tokens, self.config.block_size)
        return self._route("decode", self.decode_policy, request, (), record, hold)

    def commit(self, worker: RankedWorker, block_hashes: Sequence[BlockHash] = (), held: str | None = None) -> None:
        """Records that `worker` (from a placement made with record=False) took the request,
        and releases its hold `held` (after the write is sent, so no ranking misses both)."""
        self._record(worker, block_hashes)
        self.release(held)

    def release(self, held: str | None) -> None:
        """Ends a hold without recording anything (the request went nowhere it ranked)."""
        if held is not None:
            with self._ranking:
                self._held.release(held)

    def complete(self, worker_id: str, num_new_tokens: int) -> None:
        """A committed request finished: its pending load leaves the worker's count at once,
        instead of when the worker's next load report arrives."""
        try:
            self.index.complete_placement(worker_id, num_new_tokens)
        except redis.RedisError as e:
            self._on_redis_error(e)

    def worker_info(self, worker_id: str) -> WorkerInfo | None:
        return self._infos.get(worker_id)

    def retire_at(self, addresses: Iterable[str]) -> list[str]:
        """Retires (PrefixIndex.retire) the workers served at these addresses (Serve replica
        ids that left a handle's replica set): they leave every router's ranking now, not
        when their heartbeats lapse. Returns the retired worker ids."""
        wanted = set(addresses)
        if not wanted:
            return []
        try:
            if not wanted <= {info.address for info in self._infos.values()}:
                for role in ("prefill", "decode"):  # learn the addresses of every registered worker
                    self._usable(self.index.query(role, ()))
            retired = [w for w, info in self._infos.items() if info.address in wanted]
            for worker_id in retired:
                self.index.retire(worker_id, RETIRED_TTL_S)
        except redis.RedisError as e:
            self._on_redis_error(e)  # its heartbeat lapses instead
            return []
        return retired

    def collect_garbage(self) -> int:
        """Deletes dead workers' entries (also done every index.gc_interval_s while routing)."""
        num = self.index.collect_garbage()
        self.counters.num_workers_collected += num
        return num

    def metrics(self) -> dict[str, int]:
        counters = self.counters
        metrics = {
            "redis_available": int(self.availability.is_available),
            "redis_errors": counters.num_redis_errors,
            "workers_collected": counters.num_workers_collected,
            "workers_skipped": counters.num_workers_skipped,
            "prompt_blocks": counters.num_prompt_blocks,
            "cached_blocks": counters.num_cached_blocks,
        }
        for (role, reason), num in sorted(counters.decisions.items()):
            metrics[f"decisions_{role}_{reason}"] = num
        return metrics

    # -- internals --------------------------------------------------------------------

    def _route(
        self,
        role: str,
        policy: RoutingPolicy,
        request: RoutingRequest,
        block_hashes: Sequence[BlockHash],
        record: bool = True,
        hold: str | None = None,
    ) -> Placement:
        if record and hold is not None:
            raise ValueError("a placement is either recorded now or held (record=False) until its commit")
        self.release(hold)  # a call ranked again does not count against its own earlier choice
        views = self._query(role, block_hashes)
        if views is None:
            placement = self._fallback(role, policy, request)  # counts its placements itself
        else:
            with self._ranking:
                placement = policy.rank(request, self._held.apply(views, block_hashes))
                if hold is not None and placement.best is not None:
                    self._held.hold(hold, placement.best, block_hashes)
            if record and placement.best is not None:
                self._record(placement.best, block_hashes)
        self.counters.decisions[role, placement.reason.value] += 1
        self._maybe_collect_garbage()
        return placement

    def _query(self, role: str, block_hashes: Sequence[BlockHash]) -> list[WorkerView] | None:
        if not self.availability.should_try():
            return None
        try:
            views = self._usable(self._query_once_more_if_closed(role, block_hashes))
        except redis.RedisError as e:
            self._on_redis_error(e)
            return None
        if self.availability.record_success():
            self._outage_requests.clear()
            self._outage_tokens.clear()
        self._last_views[role] = views
        return views

    def _query_once_more_if_closed(self, role: str, block_hashes: Sequence[BlockHash]) -> list[WorkerView]:
        """A Redis that restarted (a supervised local one is back within milliseconds) closed
        the connection this router held: the first query on it fails, a fresh connection tells
        whether Redis is back. Retried only while Redis counted as available, so an outage
        costs one extra attempt, and never after a timeout (a hung Redis is not retried)."""
        try:
            return self.index.query(role, block_hashes)
        except redis.ConnectionError:
            if not self.availability.is_available:
                raise
        return self.index.query(role, block_hashes)

    def _fallback(self, role: str, policy: RoutingPolicy, request: RoutingRequest) -> Placement:
        """Load-only ranking over the last known workers, counting this router's own placements since."""
        views = [
            dataclasses.replace(
                view,
                num_cached_blocks=0,
                num_pending_requests=view.num_pending_requests + self._outage_requests[view.worker_id],
                num_pending_tokens=view.num_pending_tokens + self._outage_tokens[view.worker_id],
            )
            for view in self._last_views.get(role, [])
        ]
        placement = policy.rank(request, views)
        if placement.best is None:
            return placement
        self._outage_requests[placement.best.worker_id] += 1
        self._outage_tokens[placement.best.worker_id] += placement.best.num_new_tokens
        return Placement(placement.ranked, PlacementReason.FALLBACK)

    def _record(self, best: RankedWorker, block_hashes: Sequence[BlockHash]) -> None:
        """Speculative entries at the prompt's checkpoints the worker was not credited with, and pending load."""
        try:
            self.index.record_placement(best.worker_id, block_hashes, best.num_new_tokens, best.num_cached_blocks)
        except redis.RedisError as e:
            self._on_redis_error(e)  # the decision stands; only the next one loses its hint

    def _usable(self, views: list[WorkerView]) -> list[WorkerView]:
        """Drops workers without a registry entry or with another block size (logged once each)."""
        usable_ids = self._usable_ids
        if all(v.worker_id in usable_ids for v in views):
            return views
        unknown = [v.worker_id for v in views if v.worker_id not in self._infos]
        if unknown:
            self._infos.update(self.index.worker_infos(unknown))
            self._forget_departed(views)
        usable = []
        for view in views:
            info = self._infos.get(view.worker_id)
            if info is None:
                continue
            if info.block_size != self.config.block_size:
                if view.worker_id in unknown:
                    self.counters.num_workers_skipped += 1
                    logger.warning(
                        "router: skipping worker %s: its block_size %d is not the router's %d",
                        view.worker_id,
                        info.block_size,
                        self.config.block_size,
                    )
                continue
            usable.append(view)
            usable_ids.add(view.worker_id)
        return usable

    def _forget_departed(self, views: list[WorkerView]) -> None:
        if len(self._infos) > 2 * len(views) + 64:
            alive = {v.worker_id for views_of_role in [views, *self._last_views.values()] for v in views_of_role}
            self._infos = {w: info for w, info in self._infos.items() if w in alive}
            self._usable_ids &= alive

    def _maybe_collect_garbage(self) -> None:
        if self._clock() < self._next_gc or not self.availability.is_available:
            return
        self._next_gc = self._clock() + self.config.index.gc_interval_s
        try:
            self.collect_garbage()
        except redis.RedisError as e:
            self._on_redis_error(e)

    def _on_redis_error(self, error: redis.RedisError) -> None:
        self.counters.num_redis_errors += 1
        self.availability.record_failure(error)
