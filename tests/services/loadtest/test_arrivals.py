"""Arrival processes: rates, burstiness statistics, reproducibility."""

from __future__ import annotations

import math

import numpy as np
import pytest
from baton.services.loadtest import seeding
from baton.services.loadtest.arrivals import ArrivalProcess
from baton.services.loadtest.errors import BenchInputError

N = 20_000


def gaps(process: ArrivalProcess, seed: int = 0) -> np.ndarray:
    return np.diff(process.sample(N, np.random.default_rng(seed)))


def test_first_arrival_at_zero_and_increasing():
    offsets = ArrivalProcess(10.0).sample(100, np.random.default_rng(0))
    assert offsets[0] == 0.0
    assert all(b >= a for a, b in zip(offsets, offsets[1:]))


def test_poisson_rate_and_exponential_gaps():
    g = gaps(ArrivalProcess(5.0))
    assert g.mean() == pytest.approx(0.2, rel=0.03)
    assert g.std() / g.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    # counts per 1 s window are Poisson: variance / mean (the dispersion index) near 1
    counts = np.bincount(np.floor(np.cumsum(g)).astype(int))[:-1]
    assert counts.mean() == pytest.approx(5.0, rel=0.05)
    assert counts.var() / counts.mean() == pytest.approx(1.0, abs=0.15)


@pytest.mark.parametrize("burstiness", [0.25, 0.5, 2.0, 4.0])
def test_gamma_keeps_the_rate_and_sets_the_variation(burstiness):
    process = ArrivalProcess(8.0, burstiness)
    assert process.kind == "gamma"
    g = gaps(process)
    assert g.mean() == pytest.approx(1 / 8.0, rel=0.04)
    assert g.std() / g.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.06)


def test_burstier_means_clumpier_windows():
    def dispersion(burstiness):
        g = gaps(ArrivalProcess(10.0, burstiness))
        counts = np.bincount(np.floor(np.cumsum(g)).astype(int))[:-1]
        return counts.var() / counts.mean()

    assert dispersion(0.25) > 2.5 > dispersion(1.0) > 0.5 > dispersion(4.0)


def test_unbounded_rate_sends_everything_at_once():
    process = ArrivalProcess(math.inf)
    assert process.kind == "immediate"
    assert process.sample(50, np.random.default_rng(0)) == [0.0] * 50


def test_seeded_runs_are_reproducible_and_seeds_differ():
    process = ArrivalProcess(3.0, 0.5)
    a = process.sample(200, seeding.rng(7, seeding.ARRIVALS, 0))
    b = process.sample(200, seeding.rng(7, seeding.ARRIVALS, 0))
    c = process.sample(200, seeding.rng(8, seeding.ARRIVALS, 0))
    d = process.sample(200, seeding.rng(7, seeding.ARRIVALS, 1))  # the next run of a sweep
    assert a == b
    assert a != c and a != d
    # a prefix of a longer draw: request i arrives at the same time whatever the count
    assert process.sample(50, seeding.rng(7, seeding.ARRIVALS, 0)) == a[:50]


def test_a_sweep_scales_one_pattern():
    # the same generator state at another rate: the same arrivals, compressed by the rate ratio
    slow = ArrivalProcess(1.0, 0.5).sample(100, seeding.rng(0, seeding.ARRIVALS))
    fast = ArrivalProcess(4.0, 0.5).sample(100, seeding.rng(0, seeding.ARRIVALS))
    assert fast == pytest.approx([t / 4 for t in slow])


@pytest.mark.parametrize(
    "rate, burstiness", [(0.0, 1.0), (-1.0, 1.0), (float("nan"), 1.0), (1.0, 0.0), (1.0, math.inf)]
)
def test_bad_parameters(rate, burstiness):
    with pytest.raises(BenchInputError):
        ArrivalProcess(rate, burstiness)
