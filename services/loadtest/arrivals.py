"""When requests (or conversations) arrive: the open-loop arrival process.

Inter-arrival gaps are gamma-distributed with shape k (`burstiness`) and scale
1 / (rate * k), so the mean gap is 1 / rate whatever k is, and the coefficient of
variation of the gaps is 1 / sqrt(k):

    burstiness = 1    exponential gaps: a Poisson process at `rate`
    burstiness < 1    burstier than Poisson (clumps of arrivals, then lulls)
    burstiness > 1    smoother than Poisson (towards evenly spaced)
    rate = inf        every arrival at t = 0; with a concurrency cap in the runner this is
                      the closed-loop "fixed concurrency" mode

The first arrival is at t = 0; arrival i is the sum of the first i gaps. Offsets are an
endless stream; the runner stops taking them at its request-count or duration bound.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from .errors import BenchInputError

_BATCH = 1024  # gaps drawn per numpy call


@dataclass(frozen=True, slots=True)
class ArrivalProcess:
    rate: float = math.inf  # mean arrivals per second; inf: all at once
    burstiness: float = 1.0  # gamma shape k; 1 is Poisson

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise BenchInputError(f"request rate must be > 0 (or inf), got {self.rate}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise BenchInputError(f"burstiness must be a positive number, got {self.burstiness}")

    @property
    def kind(self) -> str:
        if math.isinf(self.rate):
            return "immediate"
        return "poisson" if self.burstiness == 1.0 else "gamma"

    def offsets(self, rng: np.random.Generator) -> Iterator[float]:
        """Arrival times in seconds from the start: 0, then cumulative gaps."""
        now = 0.0
        yield now
        if math.isinf(self.rate):
            while True:
                yield 0.0
        scale = 1.0 / (self.rate * self.burstiness)
        while True:
            for gap in rng.gamma(self.burstiness, scale, size=_BATCH):
                now += float(gap)
                yield now

    def sample(self, num: int, rng: np.random.Generator) -> list[float]:
        stream = self.offsets(rng)
        return [next(stream) for _ in range(num)]
