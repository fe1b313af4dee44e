"""The open-loop runner against an in-process fake backend: schedules, caps, bounds, turns."""

from __future__ import annotations

import asyncio
import math

import pytest
from baton.services.loadtest import seeding
from baton.services.loadtest.errors import BenchInputError
from baton.services.loadtest.lengths import LengthDistribution as L
from baton.services.loadtest.runner import Bounds, LoadRunner, LoadSpec
from baton.services.loadtest.workloads.base import WorkloadContext
from baton.services.loadtest.workloads.multi_turn import MultiTurnWorkload
from baton.services.loadtest.workloads.random import RandomWorkload, RequestClass
from loadtest_helpers import FakeBackend


def random_workload(prompt="8", output="4"):
    workload = RandomWorkload([RequestClass("r", 1, L.parse(prompt), L.parse(output))])
    asyncio.run(workload.prepare(WorkloadContext(1000, None, None), 100))
    return workload


def run(backend, workload, load, bounds, seed=0, run_index=0):
    return asyncio.run(LoadRunner(backend, workload, load, bounds, seed, run_index).run())


def test_open_loop_sends_on_schedule_while_requests_are_in_flight():
    backend = FakeBackend(service_s=0.3)  # much slower than the gaps
    outcome = run(backend, random_workload(), LoadSpec(rate=40.0), Bounds(num_requests=12))
    records = sorted(outcome.records, key=lambda r: r.index)
    assert len(records) == 12
    expected = LoadSpec(rate=40.0).arrivals.sample(12, seeding.rng(0, seeding.ARRIVALS))
    assert [r.scheduled_s for r in records] == pytest.approx(expected)
    assert all(0 <= r.start_s - r.scheduled_s < 0.05 for r in records)  # not held back by in-flight ones
    assert backend.max_in_flight > 3
    assert outcome.duration_s == pytest.approx(max(r.start_s + r.response.end_s for r in records))


def test_concurrency_cap_is_a_closed_loop():
    backend = FakeBackend(service_s=0.05)
    outcome = run(backend, random_workload(), LoadSpec(rate=math.inf, max_concurrency=2), Bounds(num_requests=8))
    assert len(outcome.records) == 8
    assert backend.max_in_flight == 2
    assert 0.18 < outcome.duration_s < 0.4  # 4 rounds of 50 ms


def test_everything_at_once_without_a_cap():
    backend = FakeBackend(service_s=0.05)
    run(backend, random_workload(), LoadSpec(), Bounds(num_requests=10))
    assert backend.max_in_flight == 10


def test_duration_bound_stops_dispatch_and_lets_in_flight_finish():
    backend = FakeBackend(service_s=0.2)
    outcome = run(backend, random_workload(), LoadSpec(rate=50.0), Bounds(duration_s=0.3))
    starts = [r.start_s for r in outcome.records]
    assert 6 <= len(starts) <= 30  # about 15 expected
    assert max(starts) < 0.3 + 0.02
    assert all(r.response.error is None for r in outcome.records)  # none cut off
    assert outcome.duration_s > max(starts)


def test_both_bounds_the_count_wins_when_it_comes_first():
    outcome = run(FakeBackend(0.01), random_workload(), LoadSpec(rate=200.0), Bounds(num_requests=5, duration_s=10))
    assert len(outcome.records) == 5 and outcome.duration_s < 1


def test_same_seed_same_requests():
    a, b, c = FakeBackend(0.001), FakeBackend(0.001), FakeBackend(0.001)
    workload = random_workload("uniform:4:40")
    run(a, workload, LoadSpec(rate=500.0), Bounds(num_requests=10), seed=3)
    run(b, workload, LoadSpec(rate=500.0), Bounds(num_requests=10), seed=3)
    run(c, workload, LoadSpec(rate=500.0), Bounds(num_requests=10), seed=4)

    def prompts(backend):
        return sorted(tuple(r.prompt_token_ids) for _, r in backend.sent)

    assert prompts(a) == prompts(b) != prompts(c)


def multi_turn(turns=3):
    workload = MultiTurnWorkload(turns, L.parse("10"), L.parse("5"), L.parse("4"))
    asyncio.run(workload.prepare(WorkloadContext(1000, None, None), 10))
    return workload


def test_turns_extend_the_conversation_with_the_reply():
    backend = FakeBackend(service_s=0.01)
    workload = multi_turn()
    outcome = run(backend, workload, LoadSpec(rate=math.inf, max_concurrency=1), Bounds(num_requests=3))
    session = workload.session(0, 0, 0)
    sent = [request.prompt_token_ids for _, request in backend.sent]
    new = [t.new_token_ids for t in session.turns]
    assert sent[0] == new[0]
    assert sent[1] == new[0] + [10000] * 4 + new[1]  # the fake's reply to request 0 is 4 x 10000
    assert sent[2] == sent[1] + [10001] * 4 + new[2]
    records = sorted(outcome.records, key=lambda r: r.index)
    assert [(r.session_id, r.turn, r.group, r.prompt_tokens) for r in records] == [
        (0, 0, "turn-1", 10),
        (0, 1, "turn-2", 19),
        (0, 2, "turn-3", 28),
    ]
    assert records[1].scheduled_s >= records[0].start_s + backend.service_s  # due when the reply has come


def test_request_count_truncates_the_last_conversation():
    outcome = run(FakeBackend(0.005), multi_turn(3), LoadSpec(rate=100.0), Bounds(num_requests=7))
    turns = sorted((r.session_id, r.turn) for r in outcome.records)
    assert len(turns) == 7
    assert turns[-1] == (2, 0)  # sessions 0 and 1 whole, then the first turn of session 2


def test_a_failed_turn_ends_its_conversation_and_is_recorded():
    # fail the turn that carries the reply to the first request sent (conversation 0, turn 1)
    backend = FakeBackend(0.005, fail_if=lambda request: 10000 in (request.prompt_token_ids or []))
    outcome = run(backend, multi_turn(3), LoadSpec(rate=math.inf, max_concurrency=1), Bounds(num_requests=6))
    by_session = {}
    for r in sorted(outcome.records, key=lambda r: r.index):
        by_session.setdefault(r.session_id, []).append((r.turn, r.response.error))
    assert by_session == {
        0: [(0, None), (1, "UNAVAILABLE: injected")],  # no turn 2 after the failure
        1: [(0, None), (1, None), (2, None)],
    }


def test_a_crashing_backend_is_a_failed_request_not_a_hung_run():
    class Crashing(FakeBackend):
        async def send(self, request):
            raise RuntimeError("boom")

    outcome = run(Crashing(), random_workload(), LoadSpec(rate=math.inf, max_concurrency=2), Bounds(num_requests=3))
    assert [r.response.error for r in outcome.records] == ["RuntimeError: boom"] * 3


def test_bad_loads_and_bounds():
    with pytest.raises(BenchInputError, match="bound the run"):
        Bounds()
    with pytest.raises(BenchInputError):
        Bounds(num_requests=0)
    with pytest.raises(BenchInputError):
        LoadSpec(rate=-1)
    with pytest.raises(BenchInputError):
        LoadSpec(max_concurrency=0)
    with pytest.raises(BenchInputError, match="request count"):
        LoadRunner(FakeBackend(), random_workload(), LoadSpec(), Bounds(duration_s=1.0))


def test_load_labels():
    assert LoadSpec(rate=2.0).label() == "2 req/s"
    assert LoadSpec(rate=2.0, burstiness=0.5).label() == "2 req/s (burstiness 0.5)"
    assert LoadSpec(max_concurrency=4).label() == "concurrency 4"
    assert LoadSpec().label() == "all at once"
