"""Routing policies: rank the alive workers for one request, best first, with a reason.

The gateway tries the first worker and falls down the list when a replica refuses. Both
policies are pure functions of their inputs (one index query), so router replicas that
read the same Redis state decide the same. Prefill ties break by a hash of the prompt's
first block and the worker id (rendezvous hashing): the same prefix goes to the same worker,
different prefixes spread over the workers, and no worker id is favoured. Decode ties break
by worker id.

Per candidate (a WorkerView, prefix_index.py), for a prompt of T tokens and block size B:

    cached   = the prefix of the prompt the index credits it with, in blocks (its cached
               run, continued by live speculative checkpoints: prefix_index.py), at most
               (T - 1) // B (the engine always computes the last prompt token, as the
               prefix cache does)
    new      = T - cached * B              prompt tokens it would have to prefill
    requests = running + waiting + placements newer than its last load report
    queued   = waiting prefill tokens + the new tokens of those placements
    stored   = blocks the index holds for it (its whole cache, not just this prompt)
    evicts   = warm blocks the placement would evict: the new tokens' blocks beyond its cold
               free blocks (free blocks that hold nothing, or a prefix unused for longer than
               the engine's cache.warm_window_s), net of the blocks of those placements

PREFILL (PrefixAwarePolicy): imbalance guard first, affinity second.

 1. Imbalance guard. With r_max and r_min the most and fewest requests over the candidates,
        r_max - r_min > balance_abs_threshold   and   r_max > balance_rel_threshold * r_min
    means affinity has piled work onto some workers (a hot prefix): rank by load alone,
    (requests, queued, tie); reason "imbalance".
 2. Affinity. cost = overlap_weight * new + queued + eviction_weight * evicts * B, in
    tokens: the prefill this request adds on that worker, the prefill already queued ahead
    of it, and the prefill that re-computing what it evicts would cost. Rank by
    (cost, requests, stored, tie); reason "prefix" if the first worker holds part of the
    prompt, else "load". A warm worker wins while its queue is shorter than the prefill it
    saves. The eviction term keeps a new prefix off a worker whose cache is full of prefixes
    in use while another has room: without it, a worker that happens to be idle when a
    prefix first arrives takes it even if its cache then thrashes (every later request of
    its prefixes finds only part of its prompt) while the other worker's cache sits half
    empty. When every cache is full of live prefixes, the term charges all workers alike
    per new block, which only makes affinity stickier. On equal cost and load, a prompt
    goes to the worker holding the least, so idle workers split new prefixes between them;
    on equal holdings the tie-break hash spreads them.
 3. Temperature (optional). With temperature t > 0 the first worker is drawn with
    probability proportional to exp(-(cost - min cost) / (t * T)), so t = 1 means a cost
    gap of one whole prompt makes a worker e times less likely; the rest follow by cost.
    The draw is seeded by the request id: every router replica draws the same worker.

DECODE (LoadPolicy): workers with room for the sequence (free KV blocks >= T // B + 1)
first, then by (requests, -free KV blocks, id); reason "load". Free blocks are net of
the blocks that placements newer than the load report will take.

Knobs (PolicyConfig in config.py, defaults in brackets):
    balance_abs_threshold [16]  requests the busiest worker may have over the idlest one
                                before the guard can trip; 0 trips it on any spread.
    balance_rel_threshold [1.5] ... and the ratio busiest / idlest it must also exceed;
                                1.0 makes the absolute threshold the only condition.
    overlap_weight [1.0]        tokens of prefill saved versus tokens of queue accepted:
                                higher keeps prefixes sticky, 0 ignores the cache.
    eviction_weight [1.0]       tokens of prefill charged per token of warm cache a placement
                                evicts: 1 counts an evicted block as a block to recompute
                                later, 0 ignores what a placement evicts.
    temperature [0.0]           spreads near-ties; 0 is fully deterministic.

Borrowed ideas: the two thresholds of SGLang's cache-aware policy, the prefill-cost logit and
softmax temperature of Dynamo's KV router, and ranked output as in Ray Serve's
`choose_replicas`.
"""

from __future__ import annotations

import enum
import hashlib
import math
import random
import zlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from .config import PolicyConfig
from .prefix_index import WorkerView


class PlacementReason(enum.StrEnum):
    PREFIX = "prefix"  # the first worker holds part of the prompt and is cheapest
    LOAD = "load"  # no useful prefix: the least loaded worker
    IMBALANCE = "imbalance"  # the guard tripped: by load alone
    FALLBACK = "fallback"  # Redis unavailable: by load from the last known registry
    NO_WORKERS = "no_workers"  # nothing alive to route to


@dataclass(frozen=True, slots=True)
class RoutingRequest:
    request_id: str
    num_prompt_tokens: int
    block_size: int
    # What prefill ties are broken by: the prompt's first block hash, so equal prefixes tie
    # the same way (empty: the request id, for prompts shorter than a block).
    affinity_key: bytes = b""

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 1:
            raise ValueError(f"a prompt needs at least one token, got {self.num_prompt_tokens}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")

    @property
    def max_cached_blocks(self) -> int:
        return (self.num_prompt_tokens - 1) // self.block_size


@dataclass(slots=True)  # not frozen: one per worker per decision, and frozen ones cost 4x to build
class RankedWorker:
    worker_id: str
    cost: float  # what the policy ranked by (lower is better; tokens for prefill)
    num_cached_blocks: int  # usable cached prefix of the prompt there
    num_new_tokens: int  # prompt tokens it would compute
    num_evicted_blocks: int = 0  # warm cached blocks its allocation would evict


@dataclass(frozen=True, slots=True)
class Placement:
    ranked: tuple[RankedWorker, ...]  # best first
    reason: PlacementReason

    @property
    def best(self) -> RankedWorker | None:
        return self.ranked[0] if self.ranked else None

    @property
    def worker_ids(self) -> list[str]:
        return [r.worker_id for r in self.ranked]


class RoutingPolicy(ABC):
    @abstractmethod
    def rank(self, request: RoutingRequest, candidates: Sequence[WorkerView]) -> Placement:
        """Every candidate, best first; candidates come from one index query."""


class PrefixAwarePolicy(RoutingPolicy):
    """Prefill placement: see the module header."""

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()

    def rank(self, request: RoutingRequest, candidates: Sequence[WorkerView]) -> Placement:
        if not candidates:
            return Placement((), PlacementReason.NO_WORKERS)
        requests = [c.num_requests for c in candidates]
        queued = [c.num_queued_tokens for c in candidates]
        ranked = self._costs(request, candidates, queued)
        seed = zlib.crc32(request.affinity_key or request.request_id.encode())
        ties = [(zlib.crc32(r.worker_id.encode(), seed), r.worker_id) for r in ranked]
        if self.is_imbalanced(requests):
            keys = [(requests[i], queued[i], ties[i], i) for i in range(len(ranked))]
            return Placement(tuple(ranked[key[-1]] for key in sorted(keys)), PlacementReason.IMBALANCE)
        keys = [
            (r.cost, requests[i], c.num_stored_blocks, ties[i], i) for i, (r, c) in enumerate(zip(ranked, candidates))
        ]
        ranked = [ranked[key[-1]] for key in sorted(keys)]
        if self.config.temperature > 0 and len(ranked) > 1:
            ranked.insert(0, ranked.pop(self._draw(request, ranked)))
        reason = PlacementReason.PREFIX if ranked[0].num_cached_blocks > 0 else PlacementReason.LOAD
        return Placement(tuple(ranked), reason)

    def is_imbalanced(self, requests: Sequence[int]) -> bool:
        """The guard (step 1), over the candidates' request counts."""
        most, fewest = max(requests), min(requests)
        return most - fewest > self.config.balance_abs_threshold and most > self.config.balance_rel_threshold * fewest

    def _costs(
        self, request: RoutingRequest, candidates: Sequence[WorkerView], queued: list[int]
    ) -> list[RankedWorker]:
        max_cached, num_tokens, block_size = request.max_cached_blocks, request.num_prompt_tokens, request.block_size
        weight, eviction_weight = self.config.overlap_weight, self.config.eviction_weight * block_size
        ranked = []
        for candidate, num_queued in zip(candidates, queued):
            cached = min(candidate.num_cached_blocks, max_cached)
            new = num_tokens - cached * block_size
            cold = candidate.num_free_blocks(block_size) - candidate.load.num_warm_free_kv_blocks
            evicts = max(0, -(-new // block_size) - max(cold, 0))
            cost = weight * new + num_queued + eviction_weight * evicts
            ranked.append(RankedWorker(candidate.worker_id, cost, cached, new, evicts))
        return ranked

    def _draw(self, request: RoutingRequest, ranked: list[RankedWorker]) -> int:
        """Index of the softmax-drawn worker; the seed is the request id, so replicas agree."""
        scale = self.config.temperature * request.num_prompt_tokens
        weights = [math.exp(-(r.cost - ranked[0].cost) / scale) for r in ranked]
        seed = int.from_bytes(hashlib.sha256(request.request_id.encode()).digest()[:8], "little")
        point = random.Random(seed).random() * sum(weights)
        for i, weight in enumerate(weights):
            point -= weight
            if point < 0:
                return i
        return len(ranked) - 1


class LoadPolicy(RoutingPolicy):
    """Decode placement: room for the sequence first, then fewest requests, then most free KV blocks."""

    def rank(self, request: RoutingRequest, candidates: Sequence[WorkerView]) -> Placement:
        if not candidates:
            return Placement((), PlacementReason.NO_WORKERS)
        num_blocks_needed = request.num_prompt_tokens // request.block_size + 1

        def key(c: WorkerView) -> tuple:
            free = c.num_free_blocks(request.block_size)
            return (free < num_blocks_needed, c.num_requests, -free, c.worker_id)

        ordered = sorted(candidates, key=key)
        ranked = tuple(RankedWorker(c.worker_id, float(c.num_requests), 0, request.num_prompt_tokens) for c in ordered)
        return Placement(ranked, PlacementReason.LOAD)
