"""KV-cache events: what a worker's prefix cache gained and lost.

The block pool emits them; a publisher ships them (in memory for tests, Redis for the
router). Replaying `stored`/`removed`/`cleared` in sequence order onto an empty set gives
exactly the set of block hashes the pool holds, which is what the router indexes.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass

from .block_hash import BlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    seq: int  # monotonically increasing per pool
    block_hashes: tuple[BlockHash, ...]  # consecutive blocks of one sequence, in order
    parent_block_hash: BlockHash | None  # hash of the block before the first one (None: root)
    num_tokens: int  # tokens covered by these blocks (len(block_hashes) * block_size)


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    seq: int
    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    seq: int


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KVCacheSnapshot:
    """Every cached block hash at one moment: the state after all events with seq < next_seq."""

    next_seq: int
    block_hashes: frozenset[BlockHash]


class KVEventPublisher(ABC):
    """Receives each step's events in sequence order, on the engine thread; must not block it.

    A publisher that lost events (a gap, a reconnect, a restart of its sink) asks for a
    snapshot through `wants_snapshot`; the engine answers with `publish_snapshot` on its
    next step or idle tick, from the same thread, so snapshot and events stay ordered.
    """

    @abstractmethod
    def publish(self, events: list[KVEvent]) -> None: ...

    def wants_snapshot(self) -> bool:
        return False

    def publish_snapshot(self, snapshot: KVCacheSnapshot) -> None:  # noqa: B027 - optional hook
        pass

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


class NullKVEventPublisher(KVEventPublisher):
    def publish(self, events: list[KVEvent]) -> None:
        pass


class InMemoryKVEventPublisher(KVEventPublisher):
    """Keeps every event; thread-safe so tests can read while the engine runs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[KVEvent] = []

    def publish(self, events: list[KVEvent]) -> None:
        with self._lock:
            self._events.extend(events)

    @property
    def events(self) -> list[KVEvent]:
        with self._lock:
            return list(self._events)


def apply_events(index: set[BlockHash], events: list[KVEvent]) -> set[BlockHash]:
    """Replays events onto a set of cached block hashes (the router's view of one worker)."""
    for event in events:
        if isinstance(event, BlockStored):
            index.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            index.difference_update(event.block_hashes)
        else:
            index.clear()
    return index
