"""The PrefixIndex contract, run against Redis and against the in-memory model alike."""

from __future__ import annotations

import time

import pytest
from baton.services.engine.core.block_hash import hash_request_tokens
from baton.services.engine.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheSnapshot
from baton.services.roles import Role
from baton.services.router import ApplyStatus, HeartbeatResult, InMemoryPrefixIndex, WorkerLoad
from baton.services.router.prefix_index import cached_run
from testlib.fake_clock import FakeClock
from testlib.router_setup import make_config, make_index, make_info

TTL_S = 0.3
HASHES = hash_request_tokens(list(range(40)), 4)  # ten chained blocks


@pytest.fixture(params=["redis", "memory"])
def setup(request):
    """(index, clock, expire): expire() lets heartbeats of TTL_S lapse on either implementation."""
    clock = FakeClock(time.time_ns() // 1_000_000)
    if request.param == "memory":
        index = InMemoryPrefixIndex(clock=clock)

        def expire():
            clock.now += int(TTL_S * 1000) + 1
    else:
        index = make_index(make_config(request.getfixturevalue("redis_server")), clock=clock)

        def expire():
            clock.now += int(TTL_S * 1000) + 1
            time.sleep(TTL_S + 0.05)  # Redis expires heartbeat keys by its own clock

    return index, clock, expire


def stored(seq, hashes, parent=None):
    return BlockStored(seq, tuple(hashes), parent, 4 * len(hashes))


def registered(index, name="a", role=Role.PREFILL, load: WorkerLoad | None = None, **kw):
    info = make_info(name, role, **kw)
    assert index.heartbeat(info, load or WorkerLoad(), TTL_S) is HeartbeatResult.REGISTERED
    assert index.replace_blocks(info.worker_id, KVCacheSnapshot(0, frozenset()))
    return info


def test_heartbeat_registers_once_and_query_lists_alive_workers_by_role(setup):
    index, _, _ = setup
    b = registered(index, "b", load=WorkerLoad(1, 2, 30, 40, 50))
    a = registered(index, "a")
    both = registered(index, "c", Role.COLOCATED)
    registered(index, "d", Role.DECODE)
    assert index.heartbeat(a, WorkerLoad(), TTL_S) is HeartbeatResult.REFRESHED
    views = index.query("prefill", HASHES)
    assert [v.worker_id for v in views] == sorted([a.worker_id, b.worker_id, both.worker_id])
    assert views[[v.worker_id for v in views].index(b.worker_id)].load == WorkerLoad(1, 2, 30, 40, 50)
    assert len(index.query("decode", [])) == 2
    assert index.worker_infos([a.worker_id, "nobody@" + "0" * 24]) == {a.worker_id: a}
    for not_a_candidate_set in ("colocated", "both"):
        with pytest.raises(ValueError, match="role"):
            index.query(not_a_candidate_set, [])


def test_events_need_a_registration_and_a_snapshot_first(setup):
    index, _, _ = setup
    info = make_info("a")
    assert index.apply_events(info.worker_id, [stored(0, HASHES[:2])]).status is ApplyStatus.UNREGISTERED
    assert not index.replace_blocks(info.worker_id, KVCacheSnapshot(0, frozenset()))
    index.heartbeat(info, WorkerLoad(), TTL_S)
    assert index.apply_events(info.worker_id, [stored(0, HASHES[:2])]).status is ApplyStatus.MISSING
    assert index.replace_blocks(info.worker_id, KVCacheSnapshot(5, frozenset(HASHES[:3])))
    assert index.cached_blocks(info.worker_id) == set(HASHES[:3])
    assert index.apply_events(info.worker_id, [stored(5, HASHES[3:4])]).next_seq == 6


def test_events_apply_in_order_skip_repeats_and_stop_at_a_gap(setup):
    index, _, _ = setup
    worker_id = registered(index).worker_id
    result = index.apply_events(worker_id, [stored(0, HASHES[:4]), BlockRemoved(1, (HASHES[3],))])
    assert (result.status, result.next_seq) == (ApplyStatus.OK, 2)
    again = index.apply_events(worker_id, [BlockRemoved(1, (HASHES[3],)), stored(2, HASHES[4:6])])
    assert again.next_seq == 3  # seq 1 was applied already: skipped
    gap = index.apply_events(worker_id, [stored(3, HASHES[6:7]), stored(5, HASHES[7:8]), stored(6, HASHES[8:9])])
    assert (gap.status, gap.next_seq) == (ApplyStatus.GAP, 4)
    assert index.cached_blocks(worker_id) == set(HASHES[:3] + HASHES[4:7])
    index.apply_events(worker_id, [AllBlocksCleared(4)])
    assert index.cached_blocks(worker_id) == set()


def test_query_returns_the_longest_cached_consecutive_prefix(setup):
    index, _, _ = setup
    a, b = registered(index, "a").worker_id, registered(index, "b").worker_id
    index.apply_events(a, [stored(0, HASHES[:3]), stored(1, HASHES[4:8], HASHES[3])])  # a hole at block 3
    index.apply_events(b, [stored(0, HASHES[1:6], HASHES[0])])  # no first block: no prefix
    cached = {v.worker_id: v.num_cached_blocks for v in index.query("prefill", HASHES)}
    assert cached == {a: 3, b: 0}
    assert {v.num_cached_blocks for v in index.query("prefill", [])} == {0}
    stored_blocks = {v.worker_id: v.num_stored_blocks for v in index.query("prefill", HASHES)}
    assert stored_blocks == {a: 7, b: 5}  # everything each holds, of any prompt


def test_speculative_entries_count_until_they_expire_or_are_removed(setup):
    index, clock, _ = setup
    info = registered(index, "a")
    a = info.worker_id
    index.apply_events(a, [stored(0, HASHES[:2])])
    index.record_placement(a, HASHES[:6], num_new_tokens=17)
    assert index.query("prefill", HASHES)[0].num_cached_blocks == 6
    index.apply_events(a, [BlockRemoved(1, (HASHES[5],))])  # the worker evicted it: prediction gone
    assert index.query("prefill", HASHES)[0].num_cached_blocks == 4
    clock.now += int(index.config.speculative_ttl_s * 1000) + 1
    index.heartbeat(info, WorkerLoad(), TTL_S)
    assert index.query("prefill", HASHES)[0].num_cached_blocks == 2
    assert index.cached_blocks(a) == set(HASHES[:2])  # speculative entries are never "confirmed"


def test_a_clear_or_a_snapshot_drops_only_that_workers_predictions(setup):
    index, _, _ = setup
    a, b = registered(index, "a").worker_id, registered(index, "b").worker_id

    def credited():
        return {v.worker_id: v.num_cached_blocks for v in index.query("prefill", HASHES)}

    for worker_id in (a, b):
        index.record_placement(worker_id, HASHES, num_new_tokens=40)
    assert credited() == {a: 10, b: 10}
    index.apply_events(a, [AllBlocksCleared(0)])
    assert credited() == {a: 0, b: 10}
    index.record_placement(a, HASHES[:3], num_new_tokens=12)  # a new prediction after the clear counts
    assert credited() == {a: 3, b: 10}
    assert index.replace_blocks(b, KVCacheSnapshot(0, frozenset(HASHES[:2])))
    assert credited() == {a: 3, b: 2}


def test_a_placement_is_predicted_at_its_checkpoints(setup):
    index, _, _ = setup
    a = registered(index, "a").worker_id
    chain = hash_request_tokens(list(range(4 * 40)), 4)  # checkpoints 1..4, 6, 8, 12, 16, 24, 32, 40
    other = hash_request_tokens(list(range(4 * 30)) + [99_999] * 40, 4)  # shares 30 blocks with chain

    def credited(hashes):
        return index.query("prefill", hashes)[0].num_cached_blocks

    index.record_placement(a, chain[:37], num_new_tokens=148)  # checkpoints up to 32, and 37
    assert credited(chain[:37]) == 37  # the same prompt: all of it
    assert credited(chain[:40]) == 32  # shares 37 blocks: the last checkpoint of its own below that
    assert credited(other) == 24
    index.apply_events(a, [BlockRemoved(0, (chain[11],))])  # evicts block 12: its entry goes
    assert credited(chain[:37]) == 8


def test_a_placement_records_only_beyond_the_credited_prefix(setup):
    index, _, _ = setup
    a = registered(index, "a").worker_id
    chain = hash_request_tokens(list(range(4 * 40)), 4)
    index.apply_events(a, [stored(0, chain[:10])])
    index.record_placement(a, chain[:24], num_new_tokens=56, num_cached_blocks=10)
    assert index.query("prefill", chain[:24])[0].num_cached_blocks == 24  # cached 10, then 12, 16, 24
    index.apply_events(a, [BlockRemoved(1, tuple(chain[:10]))])  # the cached run is gone, and with it the start
    assert index.query("prefill", chain[:24])[0].num_cached_blocks == 0


def test_pending_placements_count_until_a_newer_load_report(setup):
    index, clock, _ = setup
    info = registered(index, "a")
    index.heartbeat(info, WorkerLoad(1, 0, 0, 10, 10), 60.0)  # outlives the clock jumps below
    clock.now += 1
    index.record_placement(info.worker_id, [], num_new_tokens=100)
    index.record_placement(info.worker_id, HASHES[:1], num_new_tokens=20)
    (view,) = index.query("prefill", [])
    assert (view.num_pending_requests, view.num_pending_tokens, view.num_requests) == (2, 120, 3)
    clock.now += 1
    index.heartbeat(info, WorkerLoad(3, 0, 0, 10, 10), 60.0)
    (view,) = index.query("prefill", [])
    assert (view.num_pending_requests, view.num_requests) == (0, 3)
    index.record_placement(info.worker_id, [], num_new_tokens=7)
    assert index.query("prefill", [])[0].num_pending_tokens == 7
    clock.now += int(index.config.pending_ttl_s * 1000)  # no report for that long: stop counting
    assert index.query("prefill", [])[0].num_pending_requests == 0


def test_completed_placements_stop_counting_at_once(setup):
    index, clock, _ = setup
    info = registered(index, "a")
    index.heartbeat(info, WorkerLoad(0, 0, 0, 10, 10), 60.0)
    clock.now += 1
    index.record_placement(info.worker_id, [], num_new_tokens=100)
    index.record_placement(info.worker_id, [], num_new_tokens=20)
    index.complete_placement(info.worker_id, 100)
    (view,) = index.query("prefill", [])
    assert (view.num_pending_requests, view.num_pending_tokens) == (1, 20)
    index.complete_placement(info.worker_id, 20)
    index.complete_placement(info.worker_id, 20)  # one too many (a report already cleared it): clamped
    (view,) = index.query("prefill", [])
    assert (view.num_pending_requests, view.num_pending_tokens) == (0, 0)


def test_a_new_epoch_wipes_the_old_one_and_an_old_epoch_is_refused(setup):
    index, _, _ = setup
    old = registered(index, "a", epoch="0" * 23 + "1")
    index.apply_events(old.worker_id, [stored(0, HASHES[:5])])
    new = registered(index, "a", epoch="0" * 23 + "2")
    views = index.query("prefill", HASHES)
    assert [(v.worker_id, v.num_cached_blocks) for v in views] == [(new.worker_id, 0)]
    assert index.cached_blocks(old.worker_id) == set()
    assert index.heartbeat(old, WorkerLoad(), TTL_S) is HeartbeatResult.SUPERSEDED
    assert [v.worker_id for v in index.query("prefill", [])] == [new.worker_id]


def test_dead_workers_are_ignored_then_collected(setup):
    index, _, expire = setup
    dead = registered(index, "dead")
    index.apply_events(dead.worker_id, [stored(0, HASHES[:4])])
    index.record_placement(dead.worker_id, HASHES[:4], 16)
    expire()
    alive = registered(index, "alive")
    assert [v.worker_id for v in index.query("prefill", HASHES)] == [alive.worker_id]
    index.record_placement(dead.worker_id, HASHES, 16)  # too late: nothing is written
    assert index.collect_garbage() == 1
    assert index.cached_blocks(dead.worker_id) == set()
    assert index.worker_infos([dead.worker_id]) == {}
    assert index.collect_garbage() == 0


def test_deregister_removes_everything(setup):
    index, _, _ = setup
    info = registered(index, "a")
    index.apply_events(info.worker_id, [stored(0, HASHES[:4])])
    index.deregister(info.worker_id)
    assert index.query("prefill", HASHES) == [] and index.cached_blocks(info.worker_id) == set()
    assert index.heartbeat(info, WorkerLoad(), TTL_S) is HeartbeatResult.REGISTERED


def test_retire_removes_everything_and_refuses_heartbeats_until_its_tombstone_expires(setup):
    index, _, expire = setup
    info = registered(index, "a")
    other = registered(index, "b")
    index.apply_events(info.worker_id, [stored(0, HASHES[:4])])
    index.retire(info.worker_id, TTL_S)
    assert [v.worker_id for v in index.query("prefill", HASHES)] == [other.worker_id]
    assert index.cached_blocks(info.worker_id) == set() and index.worker_infos([info.worker_id]) == {}
    assert index.heartbeat(info, WorkerLoad(), TTL_S) is HeartbeatResult.RETIRED
    assert index.apply_events(info.worker_id, [stored(1, HASHES[4:6])]).status is ApplyStatus.UNREGISTERED
    assert [v.worker_id for v in index.query("prefill", HASHES)] == [other.worker_id]
    next_life = make_info("a", epoch="f" * 24)  # a restarted replica: the same name, a new epoch
    assert index.heartbeat(next_life, WorkerLoad(), TTL_S) is HeartbeatResult.REGISTERED
    expire()
    assert index.heartbeat(info, WorkerLoad(), TTL_S) is not HeartbeatResult.RETIRED


def test_the_run_search_is_exact_for_prefix_closed_caches_in_logarithmic_look_ups():
    for num_blocks in [*range(0, 70), 127, 128, 129, 1000]:
        for run in {0, min(1, num_blocks), num_blocks // 3, num_blocks // 2, max(num_blocks - 1, 0), num_blocks}:
            probes = []

            def holds(position, run=run, probes=probes, num_blocks=num_blocks):
                assert 1 <= position <= num_blocks
                probes.append(position)
                return position <= run

            assert cached_run(num_blocks, holds) == run
            assert len(probes) <= 2 * max(num_blocks, 1).bit_length() + 1, (num_blocks, run, probes)


def test_the_run_search_trusts_prefix_closure():
    held = {1, 2, 4, 5, 6, 7, 8}  # a hole at block 3, which blocks 2, 4 and 8 hide from the probes
    assert cached_run(8, held.__contains__) == 8
    assert cached_run(8, {1, 2, 3, 5}.__contains__) == 3
