"""Helpers for the end-to-end checks that a big or slow request does not hold others up, and
for reading a counter off Ray's Prometheus endpoint."""

from __future__ import annotations

import re
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

# How much a small request may slow down beside big or slow ones: its median, and its worst
# (on a shared 2-core machine, with margin; the measured numbers are printed).
SMALL_REQUEST_MARGIN_S = 0.03
SMALL_REQUEST_MAX_MARGIN_S = 0.2


@dataclass
class Beside:
    """Latencies of a small request alone and beside big ones, and what the big ones got."""

    baseline_s: list[float]
    during_s: list[float]
    big_results: list = field(default_factory=list)
    big_s: list[float] = field(default_factory=list)

    def report(self, what: str) -> str:
        def ms(values):
            return f"p50 {statistics.median(values) * 1e3:.1f} ms, max {max(values) * 1e3:.1f} ms (n={len(values)})"

        big = f"{len(self.big_s)} big ones, {statistics.median(self.big_s) * 1e3:.0f} ms each"
        line = f"{what}: small alone {ms(self.baseline_s)}; beside {big}: small {ms(self.during_s)}"
        print("\n" + line)
        return line

    @property
    def added_p50_s(self) -> float:
        return statistics.median(self.during_s) - statistics.median(self.baseline_s)


def timed(call: Callable[[], object]) -> tuple[float, object]:
    start = time.monotonic()
    result = call()
    return time.monotonic() - start, result


def small_beside_big(small: Callable[[], object], big: Callable[[], object], num_big: int = 5) -> Beside:
    """Runs `small` alone, then again and again while `num_big` big requests go one after the
    other in a thread; each big request's result is kept (an exception counts as one)."""
    small()  # warm: connections, caches
    baseline = [timed(small)[0] for _ in range(15)]
    measured = Beside(baseline, [])

    def bigs():
        for _ in range(num_big):
            start = time.monotonic()
            try:
                measured.big_results.append(big())
            except Exception as error:  # the error is the result under test
                measured.big_results.append(error)
            measured.big_s.append(time.monotonic() - start)

    thread = threading.Thread(target=bigs)
    thread.start()
    while thread.is_alive():
        measured.during_s.append(timed(small)[0])
    thread.join()
    return measured


def counter_value(metrics_address: str, name: str, **labels: str) -> float:
    """The sum over every series of `name` (Ray's `ray_` prefix added) whose labels include
    `labels` (Ray adds its own: node, worker, session)."""
    text = httpx.get(metrics_address, timeout=10).text
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"ray_{name}\{{(.*)\}} ([0-9.e+-]+)$", line)
        if match and all(f'{key}="{value}"' in match.group(1) for key, value in labels.items()):
            total += float(match.group(2))
    return total


def wait_for_counter(metrics_address: str, name: str, at_least: float, timeout_s: float = 40, **labels) -> float:
    deadline = time.monotonic() + timeout_s
    while True:
        value = counter_value(metrics_address, name, **labels)
        if value >= at_least or time.monotonic() > deadline:
            return value
        time.sleep(0.5)
