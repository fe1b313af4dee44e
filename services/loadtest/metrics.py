"""Metric definitions: pure functions from request records to numbers.

Per request (successful ones; times measured by the client, from just before the send):

    TTFT    time to the first chunk that carried at least one output token
    E2E     time to the end of the stream (the last message, usage included)
    ITL     the gaps between consecutive output-carrying chunks: chunk[i] - chunk[i-1], i >= 1.
            A chunk may carry several tokens (a multi-token step); it is still one gap.
    TPOT    (E2E - TTFT) / (output_tokens - 1): the mean time per output token after the
            first. Undefined for a request with fewer than 2 output tokens (left out of the
            TPOT statistics; it meets any TPOT SLO).
    output_tokens   the server's completion_tokens when it reported usage, else the client's count

Aggregated over a run (duration = run start to the last request's end):

    request throughput   completed requests / duration
    output throughput    sum of output_tokens / duration
    total throughput     sum of (prompt + output) tokens / duration
    goodput              completed requests meeting every SLO set (TTFT <= slo.ttft_s,
                         TPOT <= slo.tpot_s, E2E <= slo.e2e_s) / duration. A failed request
                         never counts; with no SLO set, goodput equals request throughput.
    cached-token ratio   sum of server-reported cached prompt tokens / sum of prompt tokens
    token check          requests whose client-counted output tokens (or client-known prompt
                         length) differ from the server's usage
    KV paths             completed requests by the server's KV path (disaggregated mode:
                         transferred, or recomputed when the handover failed)
    percentiles          linear interpolation between closest ranks (numpy's default): for
                         sorted values x[0..n-1], rank h = (n - 1) * q / 100 and
                         p_q = x[floor h] + (h - floor h) * (x[floor h + 1] - x[floor h]).
                         ITL percentiles pool every gap of every request.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .records import RequestRecord

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (rank - low) * (ordered[high] - ordered[low])


@dataclass(frozen=True, slots=True)
class Stats:
    count: int
    mean: float
    std: float  # population standard deviation
    min: float
    p50: float
    p90: float
    p99: float
    max: float


def summarize(values: Sequence[float]) -> Stats:
    if not values:
        nan = math.nan
        return Stats(0, nan, nan, nan, nan, nan, nan, nan)
    n = len(values)
    mean = math.fsum(values) / n
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / n)
    p50, p90, p99 = (percentile(values, q) for q in PERCENTILES)
    return Stats(n, mean, std, min(values), p50, p90, p99, max(values))


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    ok: bool  # completed without error
    ttft_s: float | None
    tpot_s: float | None  # None: failed, or fewer than 2 output tokens
    itl_s: tuple[float, ...]
    e2e_s: float | None
    output_tokens: int  # server-reported when available, else client-counted
    prompt_tokens: int | None  # server-reported when available, else client-known
    cached_tokens: int | None  # server-reported


def request_metrics(record: RequestRecord) -> RequestMetrics:
    response = record.response
    usage = response.usage
    output_tokens = usage.completion_tokens if usage is not None else response.num_output_tokens
    prompt_tokens = usage.prompt_tokens if usage is not None else record.prompt_tokens
    cached = usage.cached_tokens if usage is not None else None
    times = response.chunk_times_s
    if response.error is not None or not times:
        return RequestMetrics(False, None, None, (), None, output_tokens, prompt_tokens, cached)
    ttft, e2e = times[0], response.end_s
    tpot = (e2e - ttft) / (output_tokens - 1) if output_tokens > 1 else None
    itl = tuple(b - a for a, b in zip(times, times[1:]))
    return RequestMetrics(True, ttft, tpot, itl, e2e, output_tokens, prompt_tokens, cached)


def meets_slo(metrics: RequestMetrics, slo: Slo) -> bool:
    if not metrics.ok:
        return False
    if slo.ttft_s is not None and metrics.ttft_s > slo.ttft_s:
        return False
    if slo.tpot_s is not None and metrics.tpot_s is not None and metrics.tpot_s > slo.tpot_s:
        return False
    return slo.e2e_s is None or metrics.e2e_s <= slo.e2e_s


@dataclass(frozen=True, slots=True)
class TokenCheck:
    num_checked: int  # completed requests with server usage
    output_mismatches: int  # client-counted output tokens != server completion_tokens
    prompt_mismatches: int  # client-known prompt length != server prompt_tokens


def token_check(records: Iterable[RequestRecord]) -> TokenCheck:
    checked = output_bad = prompt_bad = 0
    for record in records:
        response = record.response
        if response.error is not None or response.usage is None:
            continue
        checked += 1
        output_bad += response.num_output_tokens != response.usage.completion_tokens
        prompt_bad += record.prompt_tokens is not None and record.prompt_tokens != response.usage.prompt_tokens
    return TokenCheck(checked, output_bad, prompt_bad)


@dataclass(frozen=True, slots=True)
class RunMetrics:
    num_requests: int  # sent
    num_completed: int
    num_failed: int
    num_good: int  # completed and meeting the SLO
    duration_s: float
    request_throughput: float  # completed / s
    output_token_throughput: float  # tokens / s
    total_token_throughput: float  # (prompt + output) tokens / s
    goodput: float  # good requests / s
    ttft: Stats
    tpot: Stats
    itl: Stats
    e2e: Stats
    server_ttft: Stats  # the server's own TTFT, where it reports one
    dispatch_lag: Stats  # sent - due: the client's own lateness (high means the client is the bottleneck)
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    cached_token_ratio: float | None  # None: the server reported no cached-token counts
    tokens: TokenCheck
    kv_paths: dict[str, int]  # completed requests by the server's KV path (transferred, recomputed ...)
    errors: dict[str, int]  # failed requests by error message


def run_metrics(records: Sequence[RequestRecord], duration_s: float, slo: Slo) -> RunMetrics:
    per_request = [request_metrics(r) for r in records]
    done = [m for m in per_request if m.ok]
    num_good = sum(meets_slo(m, slo) for m in done)
    prompt_tokens = sum(m.prompt_tokens or 0 for m in done)
    output_tokens = sum(m.output_tokens for m in done)
    with_cache = [m for m in done if m.cached_tokens is not None and m.prompt_tokens]
    cached = sum(m.cached_tokens for m in with_cache)
    cached_ratio = cached / sum(m.prompt_tokens for m in with_cache) if with_cache else None
    server_ttft = [r.response.server_ttft_s for r in records if r.response.server_ttft_s is not None]
    rate = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    return RunMetrics(
        num_requests=len(records),
        num_completed=len(done),
        num_failed=len(records) - len(done),
        num_good=num_good,
        duration_s=duration_s,
        request_throughput=rate(len(done)),
        output_token_throughput=rate(output_tokens),
        total_token_throughput=rate(prompt_tokens + output_tokens),
        goodput=rate(num_good),
        ttft=summarize([m.ttft_s for m in done]),
        tpot=summarize([m.tpot_s for m in done if m.tpot_s is not None]),
        itl=summarize([gap for m in done for gap in m.itl_s]),
        e2e=summarize([m.e2e_s for m in done]),
        server_ttft=summarize(server_ttft),
        dispatch_lag=summarize([r.start_s - r.scheduled_s for r in records]),
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        cached_tokens=cached,
        cached_token_ratio=cached_ratio,
        tokens=token_check(records),
        kv_paths=dict(Counter(r.response.kv_path for r in records if r.response.error is None and r.response.kv_path)),
        errors=dict(Counter(r.response.error for r in records if r.response.error is not None)),
    )


@dataclass(frozen=True, slots=True)
class GroupMetrics:
    num_requests: int
    num_completed: int
    num_good: int
    ttft: Stats
    tpot: Stats
    e2e: Stats
    cached_token_ratio: float | None


def group_metrics(records: Sequence[RequestRecord], slo: Slo) -> dict[str, GroupMetrics]:
    """The same statistics per workload group (request class, prefix group, turn number)."""
    by_group: dict[str, list[RequestRecord]] = {}
    for record in records:
        by_group.setdefault(record.group, []).append(record)
    out = {}
    for group in sorted(by_group):
        run = run_metrics(by_group[group], 0.0, slo)
        out[group] = GroupMetrics(
            run.num_requests, run.num_completed, run.num_good, run.ttft, run.tpot, run.e2e, run.cached_token_ratio
        )
    return out
