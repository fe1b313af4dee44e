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

A role configured to scale to zero (autoscaling min_replicas 0: colocated or decode; prefill
at zero is served on the decode side instead) is registered here with its cold-start wait:
at zero it is not down, Serve starts a replica for a call its handle queues, so a call waits
for it, up to that many seconds, before it gets the 503.
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
        self._cold_start_s: dict[str, float] = {}  # role -> how long a call waits at zero replicas

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
            self._cold_start_s.pop(role, None)

    def allow_cold_start(self, role: str, timeout_s: float) -> None:
        """`role` may be at zero replicas by design: a call waits up to `timeout_s` for one."""
        if not timeout_s > 0:
            raise ValueError(f"cold start timeout of {role} must be > 0, got {timeout_s}")
        with self._lock:
            self._cold_start_s[role] = timeout_s

    def cold_start_s(self, role: str) -> float | None:
        """How long a call to `role` waits at zero replicas; None: it is refused at once."""
        with self._lock:
            return self._cold_start_s.get(role)

    def refuses(self, role: str) -> bool:
        """Zero replicas and none to wait for: a call to `role` gets the 503 at once."""
        return self.has_none(role) and self.cold_start_s(role) is None


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
