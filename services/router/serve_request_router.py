"""Prefix-aware placement inside Ray Serve: a `RequestRouter` backed by Baton's router.

The engine deployments declare it through `RequestRouterConfig`, so every handle to them
(the gateway's) asks it which replica gets a call. It reads the prompt's token ids from the
call, asks `PrefixRouter` (one Redis round trip: who holds the longest prefix, who is
loaded), and returns Serve's ranked replica groups, best first. Serve keeps everything else:
queue-length probes, rejection and backoff, retries, replica health.

    GenerateCall on a prefill or colocated deployment -> route_prefill (prefix, then load)
    any call on a decode deployment                  -> route_decode (load, free KV blocks)
    OpenChannel (a gateway's output channel)         -> the replica it names, only (`pinned`)
    anything else (model_info, stats)                -> all replicas, Serve's order

The placement is recorded for the replica Serve finally sends to (`on_request_routed`:
speculative prefix entries and pending load), and its pending load is removed when the
request completes (`on_request_completed`), so back-to-back requests see current load
without waiting for the worker's next load report. From its ranking to that commit (a
replica round trip) the placement is held in this handle's router (held_placements.py), so
the calls of a burst, ranked concurrently, spread over the replicas instead of all taking
the one that was least loaded before the burst.

A ranking routes the call it was made for (Serve's default matching by request id, not
FIFOMixin's, which would hand the replica chosen for one prompt's prefix to whichever call
is oldest).

Replicas the router does not know yet (just started, not registered) go last, together;
one that registered and then missed its heartbeats is fenced off (`_fence`) while another
can take the call. A replica whose actor died leaves Serve's candidates at once (Serve's
handle router drops it when a call fails on it), and every router here reports its replica
set to the gateway (router/live_replicas.py).

A replica that leaves Serve's set (Serve drains it on a scale-down or an upgrade, or its
actor died) is retired in the index at once (`PrefixRouter.retire_at`): its entries go, and
its heartbeats are refused while it finishes its streams, so no router anywhere ranks it,
nor credits it with a prefix it is about to take away.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

# Serve's default router has no public import path in Ray 2.60 (pinned in pyproject.toml).
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from .. import metrics
from ..engine.core.block_hash import BlockHash
from ..worker_calls import DecodeCall, GenerateCall, OpenChannel
from .config import RouterConfig
from .live_replicas import PublishesReplicaCount
from .policy import Placement, RankedWorker
from .router import PrefixRouter

logger = logging.getLogger(__name__)


# A ranking not followed by a send or a failure within this long belongs to a call that
# was cancelled while it queued in the handle (Serve calls back neither hook for it).
ROUTING_TTL_S = 60.0


@dataclass(slots=True)
class _Routed:
    placement: Placement
    block_hashes: list[BlockHash]
    ranked_at: float


class BatonRequestRouter(PublishesReplicaCount, RequestRouter):
    def initialize_state(self, router_config: dict, role: str) -> None:
        self.role = role
        self.router = PrefixRouter.from_config(RouterConfig.model_validate(router_config))
        self.decisions: Counter = Counter()  # by placement reason, for metrics
        self._routing: dict[str, _Routed] = {}  # internal request id -> its latest ranking, oldest first
        self._in_flight: dict[str, RankedWorker] = {}  # internal request id -> the worker that took it
        self._registered: set[str] = set()  # replica addresses seen in a live ranking
        self._fenced: set[str] = set()  # registered replicas whose heartbeat lapsed (logged once each)
        self._known: set[str] = set()  # Serve's replica set as this handle last saw it
        self.routing_ttl_s = ROUTING_TTL_S

    def update_replicas(self, replicas) -> None:
        super().update_replicas(replicas)
        current = {replica_id.to_full_id_str() for replica_id in self.curr_replicas}
        if current:  # an empty set is no drain to act on (nothing else to route to), only a risk
            self._retire(self._known - current)
        self._known = current

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self._known.discard(address := replica_id.to_full_id_str())
        self._retire({address})

    def _retire(self, addresses: set[str]) -> None:
        """Off the event loop: a Redis round trip (or a timeout) must not hold up routing."""
        if addresses:
            threading.Thread(target=self._retire_now, args=(addresses,), name="baton-retire", daemon=True).start()

    def _retire_now(self, addresses: set[str]) -> None:
        for worker_id in self.router.retire_at(addresses):
            logger.info("router: %s worker %s left Serve's replica set: retired", self.role, worker_id)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if (pin := pinned(candidate_replicas, pending_request)) is not None:
            return pin
        call = _call_of(pending_request)
        if call is None or not candidate_replicas:
            return [candidate_replicas] if candidate_replicas else []
        key = pending_request.metadata.internal_request_id
        try:
            routed = await asyncio.to_thread(self._rank, call, key)
        except Exception:  # a routing failure must not stop serving: Serve's order then
            logger.exception("prefix routing failed; using Serve's default order")
            return [candidate_replicas]
        self.decisions[routed.placement.reason.value] += 1
        metrics.record_decision(self.role, routed.placement.reason.value)
        self._routing.pop(key, None)
        self._routing[key] = routed
        self._forget_abandoned(routed.ranked_at)
        by_address = {replica.replica_id.to_full_id_str(): replica for replica in candidate_replicas}
        ranked: list[list[RunningReplica]] = []
        for worker in routed.placement.ranked:
            address = self._address(worker.worker_id)
            replica = by_address.pop(address, None)
            if replica is not None:
                ranked.append([replica])
                self._registered.add(address)
        unranked = self._fence(by_address, has_others=bool(ranked))
        if unranked:
            ranked.append(unranked)
        return ranked

    def _forget_abandoned(self, now: float) -> None:
        while self._routing:
            key, oldest = next(iter(self._routing.items()))
            if now - oldest.ranked_at < self.routing_ttl_s:
                return
            del self._routing[key]
            self.router.release(key)

    def _fence(self, unranked: dict[str, RunningReplica], has_others: bool) -> list[RunningReplica]:
        """The replicas outside the router's live ranking that may still be tried, last.

        One that registered before and dropped out has a lapsed heartbeat (hung, partitioned
        or dying; Serve may not know yet): fenced off while another replica can take the call.
        One never registered is just starting, or cannot reach Redis: tried after the ranked
        ones. With a placement by fallback (Redis unreachable) the ranking is the last known
        one, so nothing is fenced for an outage."""
        if not has_others:
            return list(unranked.values())
        kept = []
        for address, replica in unranked.items():
            if address not in self._registered:
                kept.append(replica)
            elif address not in self._fenced:
                self._fenced.add(address)
                metrics.record_fenced(self.role)
                logger.warning("router: %s replica %s missed its heartbeats: fenced off", self.role, address)
        self._fenced &= set(unranked)  # back in the ranking (or gone): not fenced any more
        return kept

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        key = pending_request.metadata.internal_request_id
        routed = self._routing.pop(key, None)
        if routed is None:
            return
        address = replica_id.to_full_id_str()
        worker = next((w for w in routed.placement.ranked if self._address(w.worker_id) == address), None)
        if worker is None:  # a replica outside the ranking (not registered yet) took it
            self.router.release(key)
            return
        self.router.commit(worker, routed.block_hashes, held=key)
        self._in_flight[key] = worker

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if self._routing.pop(internal_request_id, None) is not None:  # it failed before being routed
            self.router.release(internal_request_id)
        worker = self._in_flight.pop(internal_request_id, None)
        if worker is not None:
            self.router.complete(worker.worker_id, worker.num_new_tokens)

    def _rank(self, call: GenerateCall | DecodeCall, key: str) -> _Routed:
        generate = call.call if isinstance(call, DecodeCall) else call
        num_tokens = len(generate.prompt_token_ids)
        if self.role == "decode":
            placement = self.router.route_decode(generate.request_id, num_tokens, record=False, hold=key)
            return _Routed(placement, [], time.monotonic())
        hashes = self.router.hasher.block_hashes(generate.prompt_token_ids, generate.cache_salt)
        placement = self.router.route_prefill_hashes(generate.request_id, num_tokens, hashes, record=False, hold=key)
        return _Routed(placement, hashes, time.monotonic())

    def _address(self, worker_id: str) -> str | None:
        info = self.router.worker_info(worker_id)
        return info.address if info is not None else None


class RoundRobinRequestRouter(PublishesReplicaCount, FIFOMixin, RequestRouter):
    """Prefix-blind baseline: replicas in turn (the benchmarks' round-robin arm)."""

    def initialize_state(self, role: str) -> None:
        self.role = role
        self._next = 0

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if (pin := pinned(candidate_replicas, pending_request)) is not None:
            return pin
        if not candidate_replicas:
            return []
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        first = self._next % len(ordered)
        self._next += 1
        return [[replica] for replica in ordered[first:] + ordered[:first]]


class PowerOfTwoRequestRouter(PublishesReplicaCount, PowerOfTwoChoicesRequestRouter):
    """Serve's default choice (two replicas at random, the shorter queue), reporting its
    replica set like the others."""

    def initialize_state(self, role: str) -> None:
        self.role = role

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if (pin := pinned(candidate_replicas, pending_request)) is not None:
            return pin
        return await super().choose_replicas(candidate_replicas, pending_request)


def pinned(
    candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None
) -> list[list[RunningReplica]] | None:
    """For an OpenChannel call, the replica it names (none while that one is not a candidate:
    the gateway's open times out); None for every other call."""
    if pending_request is None:
        return None
    args: list[Any] = [*pending_request.args, *pending_request.kwargs.values()]
    channel = next((a for a in args if isinstance(a, OpenChannel)), None)
    if channel is None:
        return None
    return [[r] for r in candidate_replicas if r.replica_id.to_full_id_str() == channel.replica]


def _call_of(pending_request: PendingRequest | None) -> GenerateCall | DecodeCall | None:
    if pending_request is None:
        return None
    args: list[Any] = [*pending_request.args, *pending_request.kwargs.values()]
    return next((a for a in args if isinstance(a, GenerateCall | DecodeCall)), None)
