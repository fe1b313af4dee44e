"""The engine's KV-event publisher: a bounded hand-off to the worker agent's thread.

    engine thread                              agent thread (worker_agent.py)
    publish(events) ------> [ e5 e6 e7 ] -----> take() -> apply_events in Redis
    wants_snapshot()? <---- snapshot wanted <-- request_snapshot()  (gap, reconnect, lost index)
    publish_snapshot(s) --> [ snapshot ] -----> take() -> replace_blocks in Redis

Nothing here blocks: `publish` appends under a lock held for microseconds. Events are
never dropped silently: when the buffer would overflow, or while the index is known to be
stale, events are discarded *and* a snapshot is due, which covers every discarded event
(the engine takes the snapshot later, on its own thread, so it includes them all).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from ..engine.core.kv_events import KVCacheSnapshot, KVEvent, KVEventPublisher


@dataclass(slots=True)
class BufferCounters:
    num_events_queued: int = 0
    num_events_discarded: int = 0  # covered by a snapshot instead
    num_overflows: int = 0
    num_snapshots: int = 0  # handed over by the engine


class KVEventBuffer(KVEventPublisher):
    def __init__(self, max_events: int) -> None:
        if max_events < 1:
            raise ValueError(f"max_events must be at least 1, got {max_events}")
        self.max_events = max_events
        self.counters = BufferCounters()
        self._lock = threading.Lock()
        self._work = threading.Event()
        self._events: deque[KVEvent] = deque()
        self._snapshot: KVCacheSnapshot | None = None
        # The index starts empty, so the first thing the agent sends is a snapshot.
        self._is_stale = True  # discard events: a snapshot will cover them
        self._snapshot_wanted = True  # ask the engine for that snapshot now
        self.is_closed = False

    # -- engine side (KVEventPublisher) -----------------------------------------------

    def publish(self, events: list[KVEvent]) -> None:
        with self._lock:
            if self._is_stale or self.is_closed:
                self.counters.num_events_discarded += len(events)
                return
            if len(self._events) + len(events) > self.max_events:
                self.counters.num_overflows += 1
                self.counters.num_events_discarded += len(self._events) + len(events)
                self._events.clear()
                self._is_stale = self._snapshot_wanted = True
            else:
                self._events.extend(events)
                self.counters.num_events_queued += len(events)
        self._work.set()

    def wants_snapshot(self) -> bool:
        return self._snapshot_wanted

    def publish_snapshot(self, snapshot: KVCacheSnapshot) -> None:
        with self._lock:
            self._snapshot = snapshot
            self._events = deque(e for e in self._events if e.seq >= snapshot.next_seq)
            self._is_stale = self._snapshot_wanted = False
            self.counters.num_snapshots += 1
        self._work.set()

    def close(self) -> None:
        self.is_closed = True
        self._work.set()

    # -- agent side -------------------------------------------------------------------

    def take(self, max_events: int) -> tuple[KVCacheSnapshot | None, list[KVEvent]]:
        """The pending snapshot (to apply first), then up to max_events events after it."""
        with self._lock:
            snapshot, self._snapshot = self._snapshot, None
            num = min(max_events, len(self._events))
            events = [self._events.popleft() for _ in range(num)]
            if not self._events and self._snapshot is None:
                self._work.clear()
        return snapshot, events

    def has_work(self) -> bool:
        return self._snapshot is not None or bool(self._events)

    def wait(self, timeout: float) -> None:
        """Until there is work (or the buffer closes), at most timeout seconds."""
        with self._lock:  # a wake-up left over from work dropped since would spin the agent
            if not self._events and self._snapshot is None and not self.is_closed:
                self._work.clear()
        self._work.wait(timeout)

    def invalidate(self) -> None:
        """The index is stale (Redis unreachable): drop everything held until a snapshot is asked for."""
        with self._lock:
            self._drop_held()

    def request_snapshot(self) -> None:
        """The index lost events (a gap, a reconnect, a lost registration): resend everything."""
        with self._lock:
            self._drop_held()
            self._snapshot_wanted = True

    def _drop_held(self) -> None:
        self.counters.num_events_discarded += len(self._events)
        self._events.clear()
        self._snapshot = None
        self._is_stale = True
