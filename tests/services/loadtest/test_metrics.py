"""Metric definitions against a synthetic trace whose every number is computed by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
from baton.services.loadtest.metrics import (
    Slo,
    group_metrics,
    meets_slo,
    percentile,
    request_metrics,
    run_metrics,
    summarize,
    token_check,
)
from baton.services.loadtest.records import Usage
from loadtest_helpers import record

approx = pytest.approx


def trace():
    """Five requests (times in seconds after each send):

    r0  chunks 0.10 0.15 0.25 0.30 (1 token each), end 0.30 -> TTFT .10, TPOT .20/3, ITL .05 .10 .05
    r1  chunks 0.20 0.40 (1 and 2 tokens), end 0.45      -> TTFT .20, TPOT .25/2 = .125, ITL .20
    r2  one chunk at 0.50, end 0.50                      -> TTFT .50, no TPOT, no ITL
    r3  failed
    r4  chunks 0.05 0.07 0.09 0.11 0.13, end 0.13        -> TTFT .05, TPOT .08/4 = .02, ITL .02 x4
    """
    return [
        record([0.10, 0.15, 0.25, 0.30], 0.30, usage=Usage(100, 4, 0), group="a", index=0, scheduled=0.0, start=0.001),
        record(
            [0.20, 0.40],
            0.45,
            chunk_tokens=[1, 2],
            usage=Usage(100, 3, 50),
            group="a",
            index=1,
            scheduled=0.1,
            start=0.104,
        ),
        record([0.50], 0.50, usage=Usage(100, 1, 25), group="b", index=2, scheduled=0.2, start=0.202),
        record([], 0.0, error="UNAVAILABLE: gone", group="b", index=3, scheduled=0.3, start=0.3),
        record(
            [0.05, 0.07, 0.09, 0.11, 0.13],
            0.13,
            usage=Usage(100, 5, None),
            group="b",
            index=4,
            scheduled=0.4,
            start=0.41,
        ),
    ]


def test_percentile_interpolates_between_closest_ranks():
    values = [0.50, 0.05, 0.20, 0.10]  # sorted: .05 .10 .20 .50
    assert percentile(values, 0) == 0.05
    assert percentile(values, 100) == 0.50
    assert percentile(values, 50) == approx(0.15)  # rank 1.5
    assert percentile(values, 90) == approx(0.41)  # rank 2.7: .20 + .7 * .30
    assert percentile(values, 99) == approx(0.491)  # rank 2.97
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


def test_percentile_matches_numpy_default():
    rng = np.random.default_rng(3)
    for n in (1, 2, 5, 17, 100):
        values = rng.exponential(1.0, n).tolist()
        for q in (0, 1, 25, 50, 90, 99, 100):
            assert percentile(values, q) == approx(float(np.percentile(values, q)))


def test_per_request_definitions():
    r0, r1, r2, r3, r4 = (request_metrics(r) for r in trace())
    assert (r0.ttft_s, r0.e2e_s) == (0.10, 0.30)
    assert r0.tpot_s == approx(0.20 / 3)
    assert r0.itl_s == approx((0.05, 0.10, 0.05))
    assert r1.tpot_s == approx(0.125)  # (0.45 - 0.20) / (3 - 1): the 2-token chunk counts as 2 tokens ...
    assert r1.itl_s == approx((0.20,))  # ... but as one gap
    assert r2.tpot_s is None and r2.itl_s == ()
    assert not r3.ok and r3.ttft_s is None
    assert r4.tpot_s == approx(0.02)
    assert r4.cached_tokens is None  # not reported


def test_aggregates_of_the_trace():
    m = run_metrics(trace(), duration_s=2.0, slo=Slo())
    assert (m.num_requests, m.num_completed, m.num_failed) == (5, 4, 1)
    assert m.request_throughput == approx(2.0)  # 4 completed / 2 s
    assert m.output_tokens == 13 and m.output_token_throughput == approx(6.5)
    assert m.prompt_tokens == 400 and m.total_token_throughput == approx(206.5)
    # TTFT over .10 .20 .50 .05
    assert (m.ttft.count, m.ttft.mean, m.ttft.min, m.ttft.max) == (4, approx(0.2125), 0.05, 0.50)
    assert (m.ttft.p50, m.ttft.p90, m.ttft.p99) == (approx(0.15), approx(0.41), approx(0.491))
    # TPOT over .02 .0667 .125 (r2 has none)
    assert m.tpot.count == 3
    assert m.tpot.p50 == approx(0.20 / 3)
    assert m.tpot.p90 == approx(0.20 / 3 + 0.8 * (0.125 - 0.20 / 3))  # rank 1.8
    # ITL pools every gap: .02 .02 .02 .02 .05 .05 .10 .20
    assert m.itl.count == 8
    assert (m.itl.p50, m.itl.p90, m.itl.p99) == (approx(0.035), approx(0.13), approx(0.193))
    assert m.itl.mean == approx(0.48 / 8)
    # E2E over .30 .45 .50 .13: sorted .13 .30 .45 .50
    assert (m.e2e.p50, m.e2e.p90) == (approx(0.375), approx(0.485))
    # cached: (0 + 50 + 25) / 300; r4 did not report, so it is left out of both sums
    assert m.cached_tokens == 75 and m.cached_token_ratio == approx(0.25)
    # dispatch lag: .001 .004 .002 0 .01
    assert m.dispatch_lag.max == approx(0.01) and m.dispatch_lag.p50 == approx(0.002)
    # with no SLO every completed request is good
    assert m.num_good == 4 and m.goodput == approx(2.0)


def test_goodput_counts_exactly_the_requests_meeting_both_slos():
    records = trace()
    slo = Slo(ttft_s=0.20, tpot_s=0.10)
    good = [meets_slo(request_metrics(r), slo) for r in records]
    # r0 meets both; r1 meets TTFT (0.20 <= 0.20) but not TPOT (.125); r2 misses TTFT;
    # r3 failed; r4 meets both
    assert good == [True, False, False, False, True]
    m = run_metrics(records, duration_s=2.0, slo=slo)
    assert m.num_good == 2 and m.goodput == approx(1.0)


def test_a_single_token_request_meets_any_tpot_slo():
    slo = Slo(ttft_s=0.5, tpot_s=0.10)
    good = [meets_slo(request_metrics(r), slo) for r in trace()]
    assert good == [True, False, True, False, True]  # r2: TTFT .50 <= .50, no TPOT
    assert run_metrics(trace(), 2.0, Slo(e2e_s=0.35)).num_good == 2  # r0 (.30) and r4 (.13)


def test_token_check_compares_client_and_server_counts():
    records = [
        record([0.1, 0.2], 0.2, usage=Usage(100, 2, 0)),  # agrees
        record([0.1, 0.2], 0.2, usage=Usage(100, 3, 0)),  # a token the client did not see
        record([0.1], 0.1, usage=Usage(101, 1, 0)),  # prompt length differs
        record([0.1], 0.1, usage=None),  # no usage: not checked
        record([], 0.0, usage=Usage(100, 1, 0), error="x"),  # failed: not checked
    ]
    check = token_check(records)
    assert (check.num_checked, check.output_mismatches, check.prompt_mismatches) == (3, 1, 1)
    # without usage, the client's count is the output count
    assert request_metrics(records[3]).output_tokens == 1


def test_group_metrics_split_by_group():
    groups = group_metrics(trace(), Slo(ttft_s=0.2))
    assert sorted(groups) == ["a", "b"]
    assert (groups["a"].num_requests, groups["a"].num_completed, groups["a"].num_good) == (2, 2, 2)
    assert (groups["b"].num_requests, groups["b"].num_completed, groups["b"].num_good) == (3, 2, 1)
    assert groups["a"].ttft.p50 == approx(0.15)
    assert groups["b"].cached_token_ratio == approx(0.25)


def test_empty_runs_summarize_to_nan():
    stats = summarize([])
    assert stats.count == 0 and math.isnan(stats.p99)
    m = run_metrics([], 0.0, Slo())
    assert m.num_requests == 0 and m.request_throughput == 0.0 and m.cached_token_ratio is None
