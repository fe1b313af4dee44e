"""Placement quality: prefix-aware routing vs round robin vs an oracle, in a simulation.

Four prefill workers, each a real `KVCacheManager` (finite, LRU-evicting prefix cache that
emits the real KV events), serve a shared-prefix workload: 64 prefix groups (system
prompts) with Zipf popularity, each request its group's prefix plus a unique suffix,
Poisson arrivals. Time is virtual; a worker prefills one request at a time, taking
overhead + uncached tokens / prefill rate, and frees its blocks when done (they stay
cached until evicted). Policies:

  prefix-aware  the real PrefixRouter, policy and Redis index (a local redis-server): KV
                events reach Redis --event-delay-ms after they happen, load reports every
                --report-ms; speculative entries and pending placements fill the gaps
  round-robin   cycles through the workers
  oracle        the same policy, fed exact knowledge at decision time: every worker's cache
                and queue (blocks queued requests will cache count as cached), exact loads

Measured: token hit rate of the prefix caches (cache-hit prompt tokens / prompt tokens, as
the engine's KV-cache manager finds them when a request starts), load balance (max / mean
of per-worker busy time, and of requests), and time to first token (queueing + prefill).

  python bench/router_placement.py [--requests 4000] [--rate 60] [--cache-blocks 1536] [--eviction-weight 1]
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
from collections import deque
from dataclasses import dataclass, field

import numpy as np
from baton.services.engine.api.sampling_params import SamplingParams
from baton.services.engine.core.block_hash import hash_request_tokens
from baton.services.engine.core.kv_cache_manager import KVCacheManager
from baton.services.engine.core.kv_events import KVCacheSnapshot
from baton.services.engine.core.request import Request
from baton.services.roles import Role
from baton.services.router import (
    Keyspace,
    PolicyConfig,
    PrefixAwarePolicy,
    PrefixRouter,
    RedisConfig,
    RedisPrefixIndex,
    RouterConfig,
    RoutingRequest,
    WorkerInfo,
    WorkerLoad,
    WorkerView,
    create_redis_client,
)
from common import redis_url

BLOCK_SIZE = 16
VOCAB = 32_000


@dataclass(slots=True)
class SimRequest:
    request_id: str
    token_ids: list[int]
    block_hashes: list[bytes]
    arrival_ms: float
    start_ms: float = 0.0
    num_hit_tokens: int = 0


@dataclass(slots=True)
class SimWorker:
    info: WorkerInfo
    kv: KVCacheManager
    queue: deque = field(default_factory=deque)  # waiting SimRequests, FIFO
    running: SimRequest | None = None
    running_request: Request | None = None
    outbox: deque = field(default_factory=deque)  # (due ms, events) not yet in the index
    busy_ms: float = 0.0
    num_requests: int = 0

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    def load(self) -> WorkerLoad:
        queued = sum(len(r.token_ids) for r in self.queue)
        pool = self.kv.pool
        return WorkerLoad(
            int(self.running is not None),
            len(self.queue),
            queued,
            pool.num_free_blocks,
            pool.num_blocks,
            pool.num_warm_free_blocks,
        )

    def take_events(self, due_ms: float) -> None:
        events = self.kv.pool.take_events()
        if events:
            self.outbox.append((due_ms, events))


class Simulation:
    def __init__(self, args: argparse.Namespace, policy_name: str, redis_url: str | None) -> None:
        self.args = args
        self.policy_name = policy_name
        self.now_ms = 0.0
        self.workers = [
            SimWorker(
                WorkerInfo(f"p{i}", f"{i + 1:024x}", Role.PREFILL, "sim", BLOCK_SIZE, 1, f"p{i}"),
                KVCacheManager(
                    BLOCK_SIZE, args.cache_blocks, warm_window_s=args.warm_window_s, clock=lambda: self.now_ms / 1000
                ),
            )
            for i in range(args.workers)
        ]
        self.by_id = {w.worker_id: w for w in self.workers}
        self.policy = PrefixAwarePolicy(PolicyConfig(eviction_weight=args.eviction_weight))
        self.round_robin = itertools.cycle(self.workers)
        self.ttft_ms: list[float] = []
        self.router = self._make_router(redis_url) if policy_name == "prefix-aware" else None

    # -- the three policies -------------------------------------------------------------

    def choose(self, request: SimRequest) -> SimWorker:
        if self.policy_name == "round-robin":
            return next(self.round_robin)
        if self.policy_name == "prefix-aware":
            placement = self.router.route_prefill_hashes(
                request.request_id, len(request.token_ids), request.block_hashes
            )
            return self.by_id[placement.worker_ids[0]]
        views = [self._oracle_view(w, request) for w in self.workers]
        placement = self.policy.rank(
            RoutingRequest(request.request_id, len(request.token_ids), BLOCK_SIZE, request.block_hashes[0]), views
        )
        return self.by_id[placement.worker_ids[0]]

    def _oracle_view(self, worker: SimWorker, request: SimRequest) -> WorkerView:
        ahead = [r for r in (worker.running, *worker.queue) if r is not None]
        will_hold = set(worker.kv.pool.cached).union(*(r.block_hashes for r in ahead))
        cached = next((i for i, h in enumerate(request.block_hashes) if h not in will_hold), len(request.block_hashes))
        return WorkerView(worker.worker_id, worker.load(), 0, cached, 0, 0, len(worker.kv.pool.cached))

    def _make_router(self, redis_url: str) -> PrefixRouter:
        config = RouterConfig(
            model="sim",
            block_size=BLOCK_SIZE,
            redis=RedisConfig(url=redis_url, socket_timeout_s=5),
            policy=self.policy.config,
        )
        client = create_redis_client(config.redis)
        client.flushall()
        index = RedisPrefixIndex(client, Keyspace("baton", "sim"), config.index, clock=lambda: int(self.now_ms))
        for worker in self.workers:
            index.heartbeat(worker.info, worker.load(), ttl_s=3600)
            index.replace_blocks(worker.worker_id, KVCacheSnapshot(0, frozenset()))
        return PrefixRouter(config, index, clock=lambda: self.now_ms / 1000)

    # -- the event loop -----------------------------------------------------------------

    def run(self, requests: list[SimRequest]) -> dict:
        events: list = []
        seq = itertools.count()
        for request in requests:
            heapq.heappush(events, (request.arrival_ms, next(seq), "arrive", request))
        report_at = 0.0
        while events:
            self.now_ms, _, kind, payload = heapq.heappop(events)
            if self.router is not None:
                self._deliver_events()
                while report_at <= self.now_ms:
                    for worker in self.workers:
                        self.router.index.heartbeat(worker.info, worker.load(), ttl_s=3600)
                    report_at += self.args.report_ms
            if kind == "arrive":
                worker = self.choose(payload)
                worker.queue.append(payload)
                worker.num_requests += 1
            else:
                self._finish(payload)
                worker = payload
            if worker.running is None and worker.queue:
                heapq.heappush(events, (self._start(worker), next(seq), "finish", worker))
        return self._results(requests)

    def _start(self, worker: SimWorker) -> float:
        """Prefills the next queued request; returns when it finishes."""
        request = worker.queue.popleft()
        engine_request = Request(request.request_id, request.token_ids, SamplingParams(), frozenset(), 1)
        hits, num_hit = worker.kv.get_computed_blocks(engine_request)
        if worker.kv.allocate_slots(engine_request, len(request.token_ids) - num_hit, hits) is None:
            raise RuntimeError("--cache-blocks is too small for one prompt")
        worker.take_events(self.now_ms + self.args.event_delay_ms)
        request.start_ms, request.num_hit_tokens = self.now_ms, num_hit
        worker.running, worker.running_request = request, engine_request
        service_ms = self.args.overhead_ms + 1000 * (len(request.token_ids) - num_hit) / self.args.prefill_rate
        worker.busy_ms += service_ms
        return self.now_ms + service_ms

    def _finish(self, worker: SimWorker) -> None:
        self.ttft_ms.append(self.now_ms - worker.running.arrival_ms)
        worker.kv.free(worker.running_request)
        worker.take_events(self.now_ms + self.args.event_delay_ms)
        worker.running = worker.running_request = None

    def _deliver_events(self) -> None:
        for worker in self.workers:
            while worker.outbox and worker.outbox[0][0] <= self.now_ms:
                result = self.router.index.apply_events(worker.worker_id, worker.outbox.popleft()[1])
                assert not result.needs_snapshot, result

    def _results(self, requests: list[SimRequest]) -> dict:
        busy = np.array([w.busy_ms for w in self.workers])
        counts = np.array([w.num_requests for w in self.workers])
        return {
            "hit_rate": sum(r.num_hit_tokens for r in requests) / sum(len(r.token_ids) for r in requests),
            "busy_max_mean": busy.max() / busy.mean(),
            "requests_max_mean": counts.max() / counts.mean(),
            "ttft_p50": float(np.percentile(self.ttft_ms, 50)),
            "ttft_p99": float(np.percentile(self.ttft_ms, 99)),
            "utilization": busy.sum() / (len(self.workers) * self.now_ms),
        }


def make_workload(args: argparse.Namespace) -> list[SimRequest]:
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(VOCAB) for _ in range(args.prefix_tokens)] for _ in range(args.groups)]
    weights = [1 / (rank + 1) ** args.zipf for rank in range(args.groups)]
    requests, now = [], 0.0
    for i in range(args.requests):
        now += rng.expovariate(args.rate) * 1000
        group = rng.choices(range(args.groups), weights)[0]
        tokens = prefixes[group] + [rng.randrange(VOCAB) for _ in range(args.suffix_tokens)]
        requests.append(SimRequest(f"req-{i}", tokens, hash_request_tokens(tokens, BLOCK_SIZE), now))
    return requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--groups", type=int, default=64)
    parser.add_argument("--zipf", type=float, default=1.1, help="popularity exponent of the prefix groups")
    parser.add_argument("--prefix-tokens", type=int, default=1024)
    parser.add_argument("--suffix-tokens", type=int, default=256)
    parser.add_argument("--cache-blocks", type=int, default=1536, help="per worker (a prefix is 64 blocks)")
    parser.add_argument("--rate", type=float, default=60.0, help="arrivals per second")
    parser.add_argument("--prefill-rate", type=float, default=20_000.0, help="prefill tokens per second per worker")
    parser.add_argument("--overhead-ms", type=float, default=2.0)
    parser.add_argument("--event-delay-ms", type=float, default=20.0, help="KV event to Redis latency")
    parser.add_argument("--report-ms", type=float, default=250.0, help="load report interval")
    parser.add_argument("--warm-window-s", type=float, default=30.0, help="the engine's cache.warm_window_s")
    parser.add_argument("--eviction-weight", type=float, default=1.0, help="the policy's eviction_weight")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    workload = make_workload(args)
    print(
        f"{args.requests} requests at {args.rate}/s, {args.groups} prefix groups (Zipf {args.zipf}) of "
        f"{args.prefix_tokens} tokens + {args.suffix_tokens}-token suffixes; {args.workers} workers with "
        f"{args.cache_blocks} blocks of {BLOCK_SIZE} each"
    )
    results = {}
    with redis_url() as url:
        for name in ("round-robin", "prefix-aware", "oracle"):
            requests = [SimRequest(r.request_id, r.token_ids, r.block_hashes, r.arrival_ms) for r in workload]
            results[name] = Simulation(args, name, url).run(requests)
    oracle = results["oracle"]["hit_rate"]
    print(f"{'policy':13s} {'hit rate':>8s} {'/oracle':>8s} {'busy max/mean':>14s} {'reqs max/mean':>14s} "
          f"{'util':>5s} {'TTFT p50':>9s} {'TTFT p99':>9s}")  # fmt: skip
    for name, r in results.items():
        print(f"{name:13s} {r['hit_rate']:8.3f} {r['hit_rate'] / oracle:8.3f} {r['busy_max_mean']:14.2f} "
              f"{r['requests_max_mean']:14.2f} {r['utilization']:5.2f} {r['ttft_p50']:7.1f}ms {r['ttft_p99']:7.1f}ms")  # fmt: skip


if __name__ == "__main__":
    main()
