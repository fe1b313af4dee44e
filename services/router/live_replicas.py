"""How many replicas of each engine deployment this process's handles can send to, now.

Ray Serve builds a request router inside every deployment handle, out of the caller's reach,
and keeps its replica set current: the controller's updates, and at once when a call fails
because its replica's actor died. With no replica left, Serve queues a call until one comes
back, and a client waits with nothing to show for it. The gateway reads this view instead,
to answer 503 with Retry-After right away, and to prefill on the decode side when no prefill
replica is left.

    Serve's handle router --update_replicas / on_replica_actor_died--> PublishesReplicaCount
                                                                           | publish(role, n)
    gateway (engine_client.guarded, DisaggregatedClient) <-- LIVE_REPLICAS.count(role)

The view is per process because the routers are: each gateway replica sees its own handles.
A role no router has reported yet (no call made, Serve still starting) counts as unknown,
never as zero.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from .. import metrics


@dataclass(slots=True)
class _Entry:
    count: int
    updated_at: float  # time.monotonic()


class LiveReplicas:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # Serve's routers run on their own event-loop thread
        self._entries: dict[str, _Entry] = {}

    def publish(self, role: str, count: int) -> None:
        with self._lock:
            self._entries[role] = _Entry(count, time.monotonic())

    def count(self, role: str) -> int | None:
        """Replicas of `role` a call can go to; None until a router has reported it."""
        with self._lock:
            entry = self._entries.get(role)
        return None if entry is None else entry.count

    def has_none(self, role: str) -> bool:
        return self.count(role) == 0

    def forget(self, role: str) -> None:
        with self._lock:
            self._entries.pop(role, None)


# The one view of this process: Serve instantiates the routers itself (with JSON kwargs), so
# nothing can be handed to them.
LIVE_REPLICAS = LiveReplicas()


class PublishesReplicaCount:
    """Mixin for a Serve `RequestRouter` (first in the bases): publishes its replica count to
    LIVE_REPLICAS under `self.role` whenever Serve changes the set."""

    role: str

    def update_replicas(self, replicas) -> None:
        super().update_replicas(replicas)
        LIVE_REPLICAS.publish(self.role, len(self.curr_replicas))

    def on_replica_actor_died(self, replica_id) -> None:
        known = replica_id in self.curr_replicas
        super().on_replica_actor_died(replica_id)
        LIVE_REPLICAS.publish(self.role, len(self.curr_replicas))
        if known:
            metrics.record_fenced(self.role)
