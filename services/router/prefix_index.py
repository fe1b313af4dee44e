"""The prefix index seam: which worker's prefix cache holds which blocks, and how busy it is.

Two implementations keep one contract: `RedisPrefixIndex`, shared by every router and
worker, and `InMemoryPrefixIndex`, the model the Redis one is tested against (and the
index of single-process simulations).

    worker side:  heartbeat       registers on the first call (or after the index lost the
                                  worker), then refreshes its load and its liveness TTL
                  apply_events    the worker's KV events, in sequence order; a gap, a lost
                  replace_blocks  index or a lost registration asks for a snapshot instead
    router side:  query           one round trip: every alive worker of a role, its load,
                                  and the longest cached prefix of the prompt's blocks
                  record_placement  speculative entries + pending load for the chosen worker

A block counts as cached on a worker when the worker's events say so, or when a router
recorded it speculatively and the entry has not expired. Nothing of a worker whose
heartbeat expired is ever returned; `collect_garbage` deletes its entries.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from ..engine.block_hash import BlockHash
from ..engine.kv_events import KVCacheSnapshot, KVEvent
from .worker_info import WorkerInfo, WorkerLoad

INDEX_ROLES = ("prefill", "decode")
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
    SUPERSEDED = -1  # a later epoch of this worker's name is registered: this process is stale
    REFRESHED = 0
    REGISTERED = 1  # (re-)registered: the index holds no blocks for this worker


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One alive worker as a query sees it, for one prompt."""

    worker_id: str
    load: WorkerLoad  # its latest report
    reported_at_ms: int  # when that report was written (index clock)
    num_cached_blocks: int  # longest run of the prompt's blocks, from the first, that it holds
    num_pending_requests: int  # placements newer than its report
    num_pending_tokens: int  # their uncached prompt tokens

    @property
    def num_requests(self) -> int:
        return self.load.num_requests + self.num_pending_requests

    @property
    def num_queued_tokens(self) -> int:
        return self.load.num_waiting_prefill_tokens + self.num_pending_tokens


def check_role(role: str) -> str:
    if role not in INDEX_ROLES:
        raise ValueError(f"role must be one of {INDEX_ROLES}, got {role!r}")
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
    def record_placement(self, worker_id: str, block_hashes: Sequence[BlockHash], num_new_tokens: int) -> None:
        """Speculative entries for the blocks, and pending load (nothing if the worker is not alive).

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
