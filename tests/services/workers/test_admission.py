"""Admission control's rules as a pure function of the replica's queue and clock."""

from __future__ import annotations

import pytest
from baton.services.engine.stats import EngineStats
from baton.services.serving_errors import ServerOverloadedError
from baton.services.workers.admission import Admission, AdmissionLimits
from testlib.fake_clock import FakeClock


def stats(num_waiting_prefill_tokens: int = 0) -> EngineStats:
    return EngineStats(
        num_running=0,
        num_waiting=0,
        num_waiting_prefill_tokens=num_waiting_prefill_tokens,
        num_kv_blocks=16,
        num_free_kv_blocks=16,
        kv_cache_usage=0.0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
    )


def test_the_waiting_bound_counts_requests_not_started():
    admission = Admission(AdmissionLimits(max_waiting_requests=2), FakeClock(100.0))
    admission.admit("a", 10, stats(), "w")
    admission.admit("b", 10, stats(), "w")
    with pytest.raises(ServerOverloadedError, match="2 requests waiting to start"):
        admission.admit("c", 10, stats(), "w")
    admission.started("a")
    admission.admit("c", 10, stats(), "w")
    admission.left("b")  # cancelled before it started: not counted either
    admission.admit("d", 10, stats(), "w")
    assert admission.num_queued == 2 and admission.num_shed == 1


def test_the_prompt_token_bound_names_both_numbers():
    admission = Admission(AdmissionLimits(max_waiting_prompt_tokens=1000), FakeClock(100.0))
    admission.admit("a", 900, stats(num_waiting_prefill_tokens=0), "w")  # an empty queue takes any prompt
    with pytest.raises(ServerOverloadedError, match="900 prompt tokens waiting .limit 1000, this request adds 200"):
        admission.admit("b", 200, stats(num_waiting_prefill_tokens=900), "w")


def test_the_delay_bound_follows_the_measured_start_rate():
    clock = FakeClock(100.0)
    admission = Admission(AdmissionLimits(max_queue_delay_s=2.0, window_s=5.0), clock)
    for i in range(10):  # a backlog of 10 at once
        admission.admit(f"s{i}", 10, stats(), "w")
    for i in range(8):  # while it lasts, a request starts every 0.5 s: 2 per second
        clock.now += 0.5
        admission.started(f"s{i}")
    assert admission.num_queued == 2
    assert admission.estimated_wait_s() == pytest.approx(4.0)  # the oldest queued one has waited 4 s
    admission.started("s8")
    admission.started("s9")  # drained
    for i in range(12):  # overloaded from here on: the queue never empties, 2 starts per second
        admission.admit(f"b{i}", 10, stats(), "w")
    for i in range(8):
        clock.now += 0.5
        admission.started(f"b{i}")
    assert admission.estimated_wait_s() == pytest.approx(4.0)  # 4 queued at 2/s (and the oldest waited 4 s)
    clock.now += 0.1
    admission.started("b8")
    admission.started("b9")
    admission.started("b10")  # 11 starts in 4.1 s; the one left waited 4.1 s
    with pytest.raises(ServerOverloadedError, match=r"about 4\.1 s \(limit 2 s\)") as refused:
        admission.admit("c", 10, stats(), "w")
    assert refused.value.retry_after_s == 3.0


def test_a_burst_after_a_quiet_spell_is_not_judged_by_the_quiet_spell():
    """The last start of a previous load, 2.5 s before a burst of 16, is no rate: it once put
    the burst's 13th request at 12 / (1 / 2.5 s) = 30 s and shed 8 of 16 (a vLLM comparison's
    concurrency-16 load, the fourth load on one server)."""
    clock = FakeClock(100.0)
    admission = Admission(AdmissionLimits(max_queue_delay_s=30.0, window_s=5.0), clock)
    admission.admit("previous", 10, stats(), "w")
    clock.now += 0.2
    admission.started("previous")
    clock.now += 2.5
    for i in range(16):
        admission.admit(f"burst{i}", 10, stats(), "w")
    assert admission.num_shed == 0 and admission.estimated_wait_s() == 0.0
    for i in range(4):  # the burst's own starts make the rate: 4 in 1 s, 12 left
        clock.now += 0.25
        admission.started(f"burst{i}")
    assert admission.estimated_wait_s() == pytest.approx(12 / 4.0)


def test_cancelled_requests_end_a_backlog_too():
    clock = FakeClock(100.0)
    admission = Admission(AdmissionLimits(max_queue_delay_s=1.0, window_s=5.0), clock)
    for i in range(3):
        admission.admit(f"a{i}", 10, stats(), "w")
    clock.now += 0.5
    admission.started("a0")
    clock.now += 0.5
    admission.started("a1")
    admission.left("a2")  # cancelled: the backlog is gone
    clock.now += 0.5
    for i in range(10):
        admission.admit(f"b{i}", 10, stats(), "w")
    assert admission.estimated_wait_s() == 0.0


def test_a_queue_that_does_not_drain_is_judged_by_its_oldest_request():
    clock = FakeClock(100.0)
    admission = Admission(AdmissionLimits(max_queue_delay_s=3.0), clock)
    admission.admit("stuck", 10, stats(), "w")
    clock.now += 2.0
    admission.admit("next", 10, stats(), "w")
    clock.now += 5.0
    with pytest.raises(ServerOverloadedError) as refused:
        admission.admit("late", 10, stats(), "w")
    assert refused.value.retry_after_s == 4.0  # 7 s waited, 3 s allowed
    admission.started("stuck")
    admission.started("next")
    admission.admit("late", 10, stats(), "w")  # drained: admitted again


def test_a_full_batch_that_just_started_sheds_until_a_slot_frees():
    """Alike requests that start together end together: right after a wave of starts the
    start rate says "soon", but no slot frees for a whole run time (3x overload with
    max_num_seqs 8 admitted requests that then waited 3-4 s against a 1 s bound)."""
    clock = FakeClock(100.0)
    admission = Admission(AdmissionLimits(max_queue_delay_s=1.0, window_s=5.0), clock, max_running=2)
    for i in range(2):  # a run time to go by: 2.0 s from first output to end
        admission.admit(f"r{i}", 10, stats(), "w")
        admission.started(f"r{i}")
    clock.now += 2.0
    for i in range(2):
        admission.left(f"r{i}")
    for i in range(2):  # a new wave fills both slots
        admission.admit(f"w{i}", 10, stats(), "w")
        admission.started(f"w{i}")
    clock.now += 0.5  # nothing queued, but no slot frees for 1.5 s (the rate alone said 0)
    with pytest.raises(ServerOverloadedError, match=r"about 1\.5 s \(limit 1 s\)"):
        admission.admit("q0", 10, stats(), "w")
    clock.now += 0.9
    admission.admit("q0", 10, stats(), "w")  # both slots free in 0.6 s: q0 takes one,
    admission.admit("q1", 10, stats(), "w")  # q1 the other
    with pytest.raises(ServerOverloadedError, match=r"about 2\.6 s"):  # then one run time more
        admission.admit("q2", 10, stats(), "w")
    clock.now += 0.6
    admission.left("w0")
    admission.started("q0")
    # q1 takes the slot w1 frees (due now); the next one waits for q0's, a run time away
    assert admission.num_queued == 1 and admission.estimated_wait_s() == pytest.approx(2.0)


def test_free_slots_admit_at_once_and_a_replica_without_slots_ignores_run_times():
    clock = FakeClock(100.0)
    with_slots = Admission(AdmissionLimits(max_queue_delay_s=1.0), clock, max_running=4)
    without = Admission(AdmissionLimits(max_queue_delay_s=1.0), clock)  # a prefill replica
    for admission in (with_slots, without):
        admission.admit("long", 10, stats(), "w")
        admission.started("long")
        clock.now += 10.0
        admission.left("long")  # 10 s run time, where slots count
        admission.admit("a", 10, stats(), "w")
        admission.started("a")  # one of 4 slots taken, just now
        for i in range(3):  # the 3 free slots take them: no wait
            admission.admit(f"b{i}", 10, stats(), "w")
    assert with_slots.estimated_wait_s() == pytest.approx(10.0)  # a fifth waits for the first to end
    assert without.estimated_wait_s() == 0.0
