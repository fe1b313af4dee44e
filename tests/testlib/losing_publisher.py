"""A KV-event publisher that loses one chosen batch, as a broken transport would."""

from __future__ import annotations

from baton.services.engine.core.kv_events import KVCacheSnapshot, KVEvent, KVEventPublisher


class LosingPublisher(KVEventPublisher):
    """Forwards everything to `inner`, except the batch published after `lose_next` is set."""

    def __init__(self, inner: KVEventPublisher) -> None:
        self.inner = inner
        self.lose_next = False

    def publish(self, events: list[KVEvent]) -> None:
        if self.lose_next:
            self.lose_next = False
            return
        self.inner.publish(events)

    def wants_snapshot(self) -> bool:
        return self.inner.wants_snapshot()

    def publish_snapshot(self, snapshot: KVCacheSnapshot) -> None:
        self.inner.publish_snapshot(snapshot)
