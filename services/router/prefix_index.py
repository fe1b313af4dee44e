"""The prefix index seam: which worker's prefix cache holds which blocks, and how busy it is.

Two implementations keep one contract: `RedisPrefixIndex`, shared by every router and
worker, and `InMemoryPrefixIndex`, the model the Redis one is tested against (and the
index of single-process simulations).

    worker side:  heartbeat       registers on the first call (or after the index lost the
                                  worker), then refreshes its load and its liveness TTL
                  apply_events    the worker's KV events, in sequence order; a gap, a lost
                  replace_blocks  index or a lost registration asks for a snapshot instead
    router side:  query           one round trip: every alive worker of a role, its load,
                                  and the prefix of the prompt it is credited with
                  record_placement  speculative entries (at checkpoints) + pending load
                                  for the chosen worker

A query credits each worker with a prefix of the prompt, in blocks:

    cached   the longest run of the prompt's blocks, from the first, that the worker's
             events say it holds, found by a search that trusts the cache to be
             prefix-closed (holding a block means holding its whole prefix, as Baton's
             engine guarantees): block 1, then blocks 2, 4, 8, ... and the last, then
             bisection (`cached_run`). About 2 log2(n) look-ups instead of n; a cache with
             a hole is credited with some held run the search meets, not always the first
    then     the run goes on through the prompt's checkpoints beyond it (positions 1..4,
             then two per doubling: 6, 8, 12, 16, 24, 32, ...; and the prompt's last
             block) for as long as each is a live speculative entry of that worker

A placement leaves speculative entries at the checkpoints of the placed prompt beyond the
prefix the worker was credited with, each live for `speculative_ttl_s`. Block hashes
chain, so an entry for position k stands for the whole prefix of k blocks: a later prompt
sharing m blocks with the placed one is credited up to the largest checkpoint <= m (over
two thirds of m), and all m blocks when it repeats the placed prompt. Two checkpoints per
doubling, not more: the entries are most of what a placement writes and a query reads (with
four, Redis spent 186 instead of 158 us per decision in bench/router_latency.py). A removal
(or clear) event drops the entries of those blocks; a stored event leaves them (the cached
run covers them from then on); a snapshot drops them all. Nothing of a worker whose
heartbeat expired is ever returned; `collect_garbage` deletes its entries.
"""

from __future__ import annotations

import bisect
import enum
import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from ..engine.core.block_hash import BlockHash
from ..engine.core.kv_events import KVCacheSnapshot, KVEvent
from ..roles import Role
from .worker_info import WorkerInfo, WorkerLoad

INDEX_ROLES = Role.COLOCATED.index_roles  # the candidate sets a query picks from
Clock = Callable[[], int]  # milliseconds; None in a constructor means the index's own clock


class ApplyStatus(enum.StrEnum):
    OK = "ok"
    GAP = "gap"  # an event is missing: the index stopped before it
    MISSING = "missing"  # the index has no sequence for the worker (new, wiped or Redis lost it)
    UNREGISTERED = "unregistered"  # the worker is not in the registry (expired and collected)


@dataclass(frozen=True, slots=True)
class ApplyResult:
    status: ApplyStatus
    next_seq: int  # the sequence number the index expects next (-1: none)

    @property
    def needs_snapshot(self) -> bool:
        return self.status is not ApplyStatus.OK


class HeartbeatResult(enum.IntEnum):
    RETIRED = -2  # a router retired this worker (its replica is draining or gone): stop reporting
    SUPERSEDED = -1  # a later epoch of this worker's name is registered: this process is stale
    REFRESHED = 0
    REGISTERED = 1  # (re-)registered: the index holds no blocks for this worker


@dataclass(slots=True)  # not frozen: one per worker per query, and frozen ones cost 4x to build
class WorkerView:
    """One alive worker as a query sees it, for one prompt."""

    worker_id: str
    load: WorkerLoad  # its latest report
    reported_at_ms: int  # when that report was written (index clock)
    num_cached_blocks: int  # prefix of the prompt it holds or is predicted to (module header)
    num_pending_requests: int  # placements newer than its report
    num_pending_tokens: int  # their uncached prompt tokens
    num_stored_blocks: int = 0  # blocks its events say it holds, of any prompt

    @property
    def num_requests(self) -> int:
        return self.load.num_requests + self.num_pending_requests

    @property
    def num_queued_tokens(self) -> int:
        return self.load.num_waiting_prefill_tokens + self.num_pending_tokens

    def num_free_blocks(self, block_size: int) -> int:
        """Its reported free KV blocks, less those the placements newer than the report take."""
        return self.load.num_free_kv_blocks - -(-self.num_pending_tokens // block_size)


@functools.lru_cache(maxsize=4096)
def checkpoint_positions(num_blocks: int) -> tuple[int, ...]:
    """Prefix lengths (1-based block positions) that carry speculative entries, ascending.

    1..4, then two per doubling (at most two significant bits), then `num_blocks` itself.
    lua_routing.py computes the same list for a query; a test holds the two together.
    """
    positions, position, step = [], 1, 1
    while position <= num_blocks:
        positions.append(position)
        position += step
        if position >= 4 * step:
            step *= 2
    if positions and positions[-1] != num_blocks:
        positions.append(num_blocks)
    return tuple(positions)


def cached_run(num_blocks: int, holds: Callable[[int], bool]) -> int:
    """The cached run the index credits: `holds(p)` says whether the worker holds block p
    (1-based). Exact for a prefix-closed cache; lua_routing.py searches the same positions."""
    if num_blocks == 0 or not holds(1):
        return 0
    held, missing = 1, num_blocks + 1
    for position in doubling_positions(num_blocks):
        if not holds(position):
            missing = position
            break
        held = position
    while missing - held > 1:
        middle = (held + missing) // 2
        if holds(middle):
            held = middle
        else:
            missing = middle
    return held


@functools.lru_cache(maxsize=4096)
def doubling_positions(num_blocks: int) -> tuple[int, ...]:
    """2, 4, 8, ... below `num_blocks`, then `num_blocks` itself (none for one block)."""
    positions, position = [], 2
    while position < num_blocks:
        positions.append(position)
        position *= 2
    return (*positions, num_blocks) if num_blocks > 1 else ()


def checkpoints_beyond(num_blocks: int, num_cached_blocks: int) -> tuple[int, ...]:
    """The checkpoint positions of a prompt of `num_blocks` past its first `num_cached_blocks`."""
    positions = checkpoint_positions(num_blocks)
    return positions[bisect.bisect_right(positions, num_cached_blocks) :]


def check_role(role: str) -> str:
    if role not in INDEX_ROLES:
        raise ValueError(f"role must be one of {[str(r) for r in INDEX_ROLES]}, got {role!r}")
    return role


class PrefixIndex(ABC):
    # -- worker side ------------------------------------------------------------------

    @abstractmethod
    def heartbeat(self, info: WorkerInfo, load: WorkerLoad, ttl_s: float) -> HeartbeatResult:
        """Registers the worker if needed (wiping an older epoch of its name) and marks it alive for ttl_s."""

    @abstractmethod
    def deregister(self, worker_id: str) -> None:
        """Removes the worker and every entry of it (a clean shutdown)."""

    @abstractmethod
    def retire(self, worker_id: str, ttl_s: float) -> None:
        """Removes the worker as deregister does, and for ttl_s refuses its heartbeats
        (HeartbeatResult.RETIRED), so that a replica Serve stopped sending to (draining, or
        dead) leaves every router's ranking at once and cannot register again while it
        finishes its streams. Its next life registers under a new epoch, a new id."""

    @abstractmethod
    def apply_events(self, worker_id: str, events: Sequence[KVEvent]) -> ApplyResult:
        """Applies events from the expected sequence number on; stops at a gap."""

    @abstractmethod
    def replace_blocks(self, worker_id: str, snapshot: KVCacheSnapshot) -> bool:
        """Makes the worker's blocks exactly the snapshot's; False if the worker is not registered."""

    # -- router side ------------------------------------------------------------------

    @abstractmethod
    def query(self, role: str, block_hashes: Sequence[BlockHash]) -> list[WorkerView]:
        """Every alive worker of the role, sorted by id, with the prompt's cached prefix length."""

    @abstractmethod
    def record_placement(
        self, worker_id: str, block_hashes: Sequence[BlockHash], num_new_tokens: int, num_cached_blocks: int = 0
    ) -> None:
        """Speculative entries at the checkpoints of the prompt (`block_hashes`: all its full
        blocks) beyond the `num_cached_blocks` the worker was credited with, and pending load;
        nothing if the worker is not alive.

        It may return before the index has applied it, but every later `query` of this index
        object sees it.
        """

    @abstractmethod
    def complete_placement(self, worker_id: str, num_new_tokens: int) -> None:
        """A placed request finished: its pending load goes (if no load report cleared it yet)."""

    @abstractmethod
    def worker_infos(self, worker_ids: Iterable[str]) -> dict[str, WorkerInfo]:
        """The registry entries of these workers (missing ones are left out)."""

    @abstractmethod
    def collect_garbage(self) -> int:
        """Deletes every entry of workers whose heartbeat expired; returns how many workers."""

    # -- inspection -------------------------------------------------------------------

    @abstractmethod
    def cached_blocks(self, worker_id: str) -> set[BlockHash]:
        """The blocks the worker's events say it holds (no speculative entries)."""
