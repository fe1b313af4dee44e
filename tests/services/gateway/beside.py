"""Helpers for the end-to-end checks that a big or slow request does not hold others up, and
for reading a counter off Ray's Prometheus endpoint."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

# How much more a small request's median may slow down beside 10 MB requests refused by
# Baton than beside the same 10 MB answered by Serve's proxy alone (the machine's own cost of
# 10 MB arriving: on a shared 2-core machine it is tens of ms); and a loose absolute bound (the
# tokenizing event loop of before stalled everything for seconds). The numbers are printed.
GATEWAY_MARGIN_S = 0.05
SMALL_REQUEST_MAX_ADDED_S = 0.3
BIG_REQUESTS = Path(__file__).with_name("big_requests.py")
BASELINE_RUNS = 15  # of the small request alone, before the big ones and again after
ATTEMPTS = 3


@dataclass
class Beside:
    """Latencies of a small request alone and beside big ones, and what the big ones got
    (big_requests.py's outcomes)."""

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


def small_beside_big(small: Callable[[], object], kind: str, address: str, num_big: int = 20) -> Beside:
    """Runs `small` alone, then again and again while `num_big` big requests of `kind`
    (big_requests.py) go one after the other from another process, then alone again: the
    baseline is both alone runs, so a slow moment of the shared machine in one of them does
    not become the added latency."""
    small()  # warm: connections, caches
    baseline = [timed(small)[0] for _ in range(BASELINE_RUNS)]
    measured = Beside(baseline, [])
    command = [sys.executable, str(BIG_REQUESTS), kind, address, str(num_big)]
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": _paths()}
    ) as big:
        first = big.stdout.readline()  # the first big one is in: the process is warm, measure from here
        while big.poll() is None:
            measured.during_s.append(timed(small)[0])
        lines = [first, *big.stdout.read().splitlines()]
    baseline.extend(timed(small)[0] for _ in range(BASELINE_RUNS))
    outcomes = [json.loads(line) for line in lines if line.strip()]
    measured.big_results = outcomes
    measured.big_s = [outcome["s"] for outcome in outcomes]
    assert big.returncode == 0 and len(outcomes) == num_big, (big.returncode, outcomes)
    return measured


def check_no_one_held_up(small: Callable[[], object], kind: str, control: str, address: str, what: str) -> Beside:
    """`small` beside 10 MB requests of `kind` and beside the Baton-free `control`: Baton's
    part of the slowdown stays within GATEWAY_MARGIN_S in one of ATTEMPTS measurements (a stall
    of the gateway shows in every one; a busy moment of a shared 2-core machine, with the small
    request alone at 3x its usual time, in one). Returns the `kind` measurement."""
    failures = []
    for _ in range(ATTEMPTS):
        measured = small_beside_big(small, kind, address)
        baseline = small_beside_big(small, control, address)
        lines = (
            measured.report(what),
            baseline.report(f"{what}, control: the same 10 MB to the ingress's own health check, past Baton"),
        )
        assert len(measured.during_s) >= 5, lines
        if (
            measured.added_p50_s < max(baseline.added_p50_s, 0.0) + GATEWAY_MARGIN_S
            and measured.added_p50_s < SMALL_REQUEST_MAX_ADDED_S
        ):
            return measured
        failures.append(lines)
    raise AssertionError(f"small requests were held up in each of {ATTEMPTS} measurements", failures)


def _paths() -> str:
    return os.pathsep.join([str(BIG_REQUESTS.parents[2]), os.environ.get("PYTHONPATH", "")])


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
