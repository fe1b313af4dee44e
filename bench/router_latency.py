"""Router decision latency: 16 workers, 1M indexed blocks in Redis, prompts of 128 blocks.

One router, decisions back to back against a local redis-server on loopback (started here,
or --redis-url): first from one thread, then from several threads sharing the router, as
Serve's request router calls it (asyncio.to_thread), each thread with its own connection.
The index holds `--blocks` hashes spread over the workers: each worker caches 48 of 512
shared 128-block documents to a random depth, plus filler. Every request is a document's
first k blocks followed by new tokens, so workers hold prefixes of every length. A reporter thread heartbeats all workers every 250 ms, as real
workers do. Reported per decision:

  hash      the engine's block hashes of the prompt (128 blocks of 16 tokens)
  query     the index query alone: one Redis round trip (Lua)
  decision  query + policy + the speculative/pending write (sent without waiting for it)
  total     hash + decision: what `route_prefill` costs the gateway

and the time Redis spends in the scripts (INFO commandstats), per query and per placement
write: it bounds how many decisions one Redis can serve. Also the CPU time per decision,
user + system, of this process (the router; its load reporter thread adds well under 1%) and
of redis-server (INFO cpu, so also with --redis-url). With N threads: decisions/s over
the wall clock and the total's p50/p99 (which then include waiting for a busy Redis or CPU).

  python bench/router_latency.py [--decisions 20000] [--workers 16] [--blocks 1000000] [--threads 2,4]
"""

from __future__ import annotations

import argparse
import random
import threading
import time

import numpy as np
from baton.services.engine.core.kv_events import KVCacheSnapshot
from baton.services.roles import Role
from baton.services.router import (
    Keyspace,
    PrefixRouter,
    PromptHasher,
    RedisConfig,
    RedisPrefixIndex,
    RouterConfig,
    WorkerInfo,
    WorkerLoad,
    create_redis_client,
    new_epoch,
)
from common import redis_url

BLOCK_SIZE = 16
PROMPT_BLOCKS = 128
NUM_DOCS = 512
DOCS_PER_WORKER = 48
VOCAB = 32_000


def build_index(config: RouterConfig, num_workers: int, num_blocks: int, rng: random.Random):
    """Registers the workers and uploads their caches; returns (infos, documents' tokens)."""
    client = create_redis_client(config.redis, socket_timeout_s=60)
    index = RedisPrefixIndex(client, Keyspace(config.redis.key_prefix, config.model), config.index)
    hasher = PromptHasher(BLOCK_SIZE)
    docs = [[rng.randrange(VOCAB) for _ in range(PROMPT_BLOCKS * BLOCK_SIZE)] for _ in range(NUM_DOCS)]
    doc_hashes = [hasher.block_hashes(tokens) for tokens in docs]
    infos = []
    for w in range(num_workers):
        info = WorkerInfo(f"prefill-{w}", new_epoch(), Role.PREFILL, config.model, BLOCK_SIZE, 1, f"r{w}")
        cached: set[bytes] = set()
        for d in rng.sample(range(NUM_DOCS), DOCS_PER_WORKER):
            cached.update(doc_hashes[d][: rng.randint(0, PROMPT_BLOCKS)])
        while len(cached) < num_blocks // num_workers:
            cached.add(rng.randbytes(16))
        index.heartbeat(info, WorkerLoad(rng.randint(0, 8), 0, 0, 10_000, 20_000), ttl_s=3600)
        index.replace_blocks(info.worker_id, KVCacheSnapshot(0, frozenset(cached)))
        infos.append(info)
    total = sum(client.scard(index.keys.worker(i.worker_id, "cached")) for i in infos)
    memory = client.info("memory")["used_memory_human"]
    print(f"index: {num_workers} workers, {total:,} blocks, redis used_memory {memory}")
    return index, infos, docs


def report_loads(index: RedisPrefixIndex, infos: list[WorkerInfo], stop: threading.Event) -> None:
    rng = random.Random(1)
    while not stop.wait(0.25):
        for info in infos:
            index.heartbeat(info, WorkerLoad(rng.randint(0, 8), rng.randint(0, 4), 0, 10_000, 20_000), ttl_s=3600)


def make_prompt(docs: list[list[int]], rng: random.Random) -> list[int]:
    doc = docs[rng.randrange(len(docs))]
    keep = rng.randint(0, PROMPT_BLOCKS) * BLOCK_SIZE
    return doc[:keep] + [rng.randrange(VOCAB) for _ in range(PROMPT_BLOCKS * BLOCK_SIZE - keep)]


def summarize(name: str, seconds: list[float]) -> None:
    us = np.array(seconds) * 1e6
    print(
        f"{name:9s} p50 {np.percentile(us, 50):7.0f} us   p99 {np.percentile(us, 99):7.0f} us   mean {us.mean():7.0f} us"
    )


def script_usec(router: PrefixRouter) -> int:
    return router.index.client.info("commandstats").get("cmdstat_evalsha", {"usec": 0})["usec"]


def cpu_seconds(router: PrefixRouter) -> tuple[float, float]:
    """(this process, the Redis server): CPU time, user + system, so far."""
    redis_cpu = router.index.client.info("cpu")
    return time.process_time(), redis_cpu["used_cpu_user"] + redis_cpu["used_cpu_sys"]


def print_cpu(before: tuple[float, float], after: tuple[float, float], num_decisions: int) -> None:
    router_us, redis_us = ((a - b) / num_decisions * 1e6 for a, b in zip(after, before))
    print(f"CPU per decision: router process {router_us:.0f} us, redis-server {redis_us:.0f} us (user + system)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decisions", type=int, default=20_000)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--threads", default="2,4", help="thread counts to run after the one-thread run")
    parser.add_argument(
        "--redis-url", default=None, help="use this server (its data is flushed) instead of starting one"
    )
    args = parser.parse_args()
    rng = random.Random(0)
    with redis_url(args.redis_url) as url:
        config = RouterConfig(model="bench", block_size=BLOCK_SIZE, redis=RedisConfig(url=url, socket_timeout_s=1))
        create_redis_client(config.redis).flushall()
        index, infos, docs = build_index(config, args.workers, args.blocks, rng)
        stop = threading.Event()
        reporter = threading.Thread(target=report_loads, args=(index, infos, stop), daemon=True)
        reporter.start()
        run(config, docs, args.decisions, rng)
        for num_threads in [int(n) for n in args.threads.split(",") if n]:
            run_threads(config, docs, args.decisions, num_threads, rng)
        stop.set()
        reporter.join()


def run(config: RouterConfig, docs: list[list[int]], num_decisions: int, rng: random.Random) -> None:
    router = PrefixRouter.from_config(config)
    prompts = [make_prompt(docs, rng) for _ in range(num_decisions)]
    for i, tokens in enumerate(prompts[:500]):  # warm-up: scripts loaded, connections open
        router.route_prefill(f"warm-{i}", tokens)
    hash_s, decision_s, total_s, query_s = [], [], [], []
    reasons: dict[str, int] = {}
    router.index.client.config_resetstat()
    cpu_before = cpu_seconds(router)
    started = time.perf_counter()
    for i, tokens in enumerate(prompts):
        t0 = time.perf_counter()
        hashes = router.hasher.block_hashes(tokens)
        t1 = time.perf_counter()
        placement = router.route_prefill_hashes(f"req-{i}", len(tokens), hashes)
        t2 = time.perf_counter()
        hash_s.append(t1 - t0)
        decision_s.append(t2 - t1)
        total_s.append(t2 - t0)
        reasons[placement.reason.value] = reasons.get(placement.reason.value, 0) + 1
    elapsed = time.perf_counter() - started
    router.index.flush()
    cpu_after = cpu_seconds(router)
    decisions_usec = script_usec(router)
    for tokens in prompts[: num_decisions // 4]:
        hashes = router.hasher.block_hashes(tokens)
        t0 = time.perf_counter()
        router.index.query("prefill", hashes)
        query_s.append(time.perf_counter() - t0)
    query_usec = (script_usec(router) - decisions_usec) / len(query_s)
    print(f"{num_decisions} decisions, one router, one thread; reasons {reasons}")
    summarize("hash", hash_s)
    summarize("query", query_s)
    summarize("decision", decision_s)
    summarize("total", total_s)
    print(f"throughput: {num_decisions / elapsed:,.0f} decisions/s (hash included), "
          f"{num_decisions / sum(decision_s):,.0f} decisions/s (decision only)")  # fmt: skip
    per_decision = decisions_usec / num_decisions
    print(f"Redis time in scripts: {per_decision:.0f} us per decision (query and placement write), "
          f"{query_usec:.0f} us per query alone (INFO commandstats)")  # fmt: skip
    print_cpu(cpu_before, cpu_after, num_decisions)
    print(f"router metrics: {router.metrics()}")


def run_threads(config: RouterConfig, docs: list[list[int]], num_decisions: int, num_threads: int, rng) -> None:
    """The same decisions from `num_threads` threads sharing one router."""
    router = PrefixRouter.from_config(config)
    prompts = [make_prompt(docs, rng) for _ in range(num_decisions)]
    shares = [prompts[t::num_threads] for t in range(num_threads)]
    latencies: list[list[float]] = [[] for _ in range(num_threads)]
    start = threading.Barrier(num_threads + 1)

    def decide(t: int) -> None:
        for i, tokens in enumerate(shares[t][:100]):  # warm-up: this thread's connection opens
            router.route_prefill(f"warm-{t}-{i}", tokens)
        start.wait()
        for i, tokens in enumerate(shares[t]):
            t0 = time.perf_counter()
            router.route_prefill(f"req-{t}-{i}", tokens)
            latencies[t].append(time.perf_counter() - t0)

    threads = [threading.Thread(target=decide, args=(t,)) for t in range(num_threads)]
    for thread in threads:
        thread.start()
    start.wait()
    router.index.client.config_resetstat()
    cpu_before = cpu_seconds(router)
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    router.index.flush()
    print_cpu(cpu_before, cpu_seconds(router), num_decisions)
    per_decision = script_usec(router) / num_decisions
    print(f"{num_threads} threads, one router: {num_decisions / elapsed:,.0f} decisions/s (hash included); "
          f"Redis {per_decision:.0f} us per decision")  # fmt: skip
    summarize("total", [s for thread in latencies for s in thread])


if __name__ == "__main__":
    main()
