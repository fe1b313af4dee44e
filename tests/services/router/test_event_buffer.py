"""The engine-side hand-off: bounded, never blocking, and never dropping an event silently."""

from __future__ import annotations

from baton.services.engine.core.kv_events import BlockStored, KVCacheSnapshot
from baton.services.router import KVEventBuffer


def events(first: int, count: int) -> list[BlockStored]:
    return [BlockStored(seq, (seq.to_bytes(16, "little"),), None, 4) for seq in range(first, first + count)]


def synced(max_events: int = 100) -> KVEventBuffer:
    buffer = KVEventBuffer(max_events)
    assert buffer.wants_snapshot()  # the index starts empty: a snapshot goes first
    buffer.publish_snapshot(KVCacheSnapshot(0, frozenset()))
    assert buffer.take(10) == (KVCacheSnapshot(0, frozenset()), [])
    return buffer


def test_events_pass_through_in_order_in_batches():
    buffer = synced()
    buffer.publish(events(0, 3))
    buffer.publish(events(3, 4))
    assert buffer.has_work()
    assert [e.seq for e in buffer.take(5)[1]] == [0, 1, 2, 3, 4]
    assert [e.seq for e in buffer.take(5)[1]] == [5, 6]
    assert not buffer.has_work() and not buffer.wants_snapshot()


def test_overflow_is_a_gap_that_a_snapshot_covers():
    buffer = synced(max_events=5)
    buffer.publish(events(0, 4))
    buffer.publish(events(4, 2))  # would hold 6 > 5
    assert buffer.wants_snapshot() and buffer.counters.num_overflows == 1
    buffer.publish(events(6, 1))  # covered by the snapshot to come: discarded
    assert buffer.counters.num_events_discarded == 7
    buffer.publish_snapshot(KVCacheSnapshot(7, frozenset({b"x" * 16})))
    buffer.publish(events(7, 2))
    snapshot, batch = buffer.take(10)
    assert snapshot.next_seq == 7 and [e.seq for e in batch] == [7, 8]


def test_a_snapshot_supersedes_events_queued_before_it():
    buffer = synced()
    buffer.publish(events(0, 3))
    buffer.publish_snapshot(KVCacheSnapshot(2, frozenset()))
    snapshot, batch = buffer.take(10)
    assert snapshot.next_seq == 2 and [e.seq for e in batch] == [2]


def test_request_snapshot_drops_what_is_held_and_asks_the_engine():
    buffer = synced()
    buffer.publish(events(0, 3))
    buffer.request_snapshot()
    assert buffer.wants_snapshot() and not buffer.has_work()
    assert buffer.counters.num_events_discarded == 3


def test_invalidate_discards_until_a_snapshot_is_asked_for():
    buffer = synced()
    buffer.invalidate()  # Redis is down: nothing to send, and no snapshot yet either
    buffer.publish(events(0, 2))
    assert not buffer.has_work() and not buffer.wants_snapshot()
    buffer.request_snapshot()  # Redis is back
    assert buffer.wants_snapshot()


def test_close_stops_accepting():
    buffer = synced()
    buffer.close()
    buffer.publish(events(0, 2))
    assert buffer.is_closed and not buffer.has_work()
