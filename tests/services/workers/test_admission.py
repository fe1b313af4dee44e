"""Admission control's rules as a pure function of the replica's queue and clock."""

from __future__ import annotations

import pytest
from baton.services.engine.stats import EngineStats
from baton.services.serving_errors import ServerOverloadedError
from baton.services.workers.admission import Admission, AdmissionLimits


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


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
    admission = Admission(AdmissionLimits(max_waiting_requests=2), Clock())
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
    admission = Admission(AdmissionLimits(max_waiting_prompt_tokens=1000), Clock())
    admission.admit("a", 900, stats(num_waiting_prefill_tokens=0), "w")  # an empty queue takes any prompt
    with pytest.raises(ServerOverloadedError, match="900 prompt tokens waiting .limit 1000, this request adds 200"):
        admission.admit("b", 200, stats(num_waiting_prefill_tokens=900), "w")


def test_the_delay_bound_follows_the_measured_start_rate():
    clock = Clock()
    admission = Admission(AdmissionLimits(max_queue_delay_s=2.0, window_s=5.0), clock)
    for i in range(10):  # a request starts every 0.5 s: 2 per second
        admission.admit(f"s{i}", 10, stats(), "w")
        clock.now += 0.5
        admission.started(f"s{i}")
    for i in range(4):  # 4 queued at 2/s: 2 s to start the next one
        admission.admit(f"q{i}", 10, stats(), "w")
    assert admission.estimated_wait_s() == pytest.approx(4 / (10 / 4.5), rel=0.01)
    admission.admit("q4", 10, stats(), "w")
    with pytest.raises(ServerOverloadedError, match=r"about 2\.\d s \(limit 2 s\)") as refused:
        admission.admit("q5", 10, stats(), "w")
    assert refused.value.retry_after_s == 1.0


def test_a_queue_that_does_not_drain_is_judged_by_its_oldest_request():
    clock = Clock()
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
