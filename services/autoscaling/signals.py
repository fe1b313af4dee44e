"""What an engine replica reports to Serve's autoscaler, and the meters behind it.

Serve 2.60 calls a replica's `record_autoscaling_stats()` (sync or async) every
`metrics_interval_s` once the deployment has an `autoscaling_config`; the returned
dict[str, int | float] is stored per replica as a time series, and a custom
`AutoscalingPolicy` reads it as `ctx.aggregated_metrics[KEY][replica_id]` (the series
averaged over `look_back_period_s`) or `ctx.raw_metrics`. A call that raises or times out
(RAY_SERVE_RECORD_AUTOSCALING_STATS_TIMEOUT_S, 10 s) is dropped; a first result that is not
a flat dict of numbers disables the replica's custom metrics for good, so every value here
is a plain float.

The engine's snapshot (EngineStats) has the queue and the KV cache; what it does not have is
measured here, in the worker, from the outputs it streams:

    prefill tokens/s   prompt tokens prefilled / seconds with a prefill in flight, over the
                       last `window_s` (capacity while busy, not load: an idle replica does
                       not look slow)
    TPOT               seconds between a stream's outputs / tokens they carried, over the
                       last `window_s` (decode and colocated roles)
    preemptions        preemptions seen in the requests' metrics, per second over `window_s`
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from ..engine.api.outputs import RequestOutput
from ..engine.stats import EngineStats

# Keys of the dict a replica reports; policy.py reads the same names.
WAITING_PROMPT_TOKENS = "baton_waiting_prompt_tokens"
PREFILL_TOKENS_PER_S = "baton_prefill_tokens_per_s"  # 0: not measured yet
NUM_RUNNING = "baton_num_running"
NUM_WAITING = "baton_num_waiting"
KV_USAGE = "baton_kv_usage"  # fraction of KV blocks in use, 0..1
PREEMPTIONS_PER_S = "baton_preemptions_per_s"
TPOT_S = "baton_tpot_s"  # 0: not measured yet
NUM_QUEUED = "baton_num_queued"  # admitted, no first output yet (workers/admission.py)

DEFAULT_WINDOW_S = 10.0


class _WindowedSum:
    """Sums of (amount, seconds) pairs observed within the last `window_s`."""

    def __init__(self, window_s: float, clock: Callable[[], float]) -> None:
        self._window_s = window_s
        self._clock = clock
        self._points: deque[tuple[float, float, float]] = deque()  # (time, amount, seconds)

    def add(self, amount: float, seconds: float = 0.0) -> None:
        self._points.append((self._clock(), amount, seconds))

    def totals(self) -> tuple[float, float]:
        horizon = self._clock() - self._window_s
        while self._points and self._points[0][0] < horizon:
            self._points.popleft()
        return sum(p[1] for p in self._points), sum(p[2] for p in self._points)


class ReplicaSignals:
    """Meters fed by the worker's request paths; `report` is what `record_autoscaling_stats` returns."""

    def __init__(self, window_s: float = DEFAULT_WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._window_s = window_s
        self._prefill = _WindowedSum(window_s, clock)  # (prompt tokens computed, busy seconds)
        self._decode = _WindowedSum(window_s, clock)  # (tokens, seconds between outputs)
        self._preemptions = _WindowedSum(window_s, clock)
        self._num_prefilling = 0
        self._busy_since: float | None = None
        self._last_output: dict[str, tuple[float, int, int]] = {}  # id -> (time, tokens, preemptions)

    # Prefill: busy time is counted once however many prompts overlap.
    def prefill_started(self) -> None:
        if self._num_prefilling == 0:
            self._busy_since = self._clock()
        self._num_prefilling += 1

    def prefill_finished(self, num_computed_tokens: int) -> None:
        """`num_computed_tokens`: prompt tokens the engine ran (prefix-cache hits excluded)."""
        now = self._clock()
        busy = 0.0
        if self._busy_since is not None:
            busy, self._busy_since = now - self._busy_since, now
        self._num_prefilling = max(0, self._num_prefilling - 1)
        if self._num_prefilling == 0:
            self._busy_since = None
        self._prefill.add(max(0, num_computed_tokens), busy)

    def output(self, output: RequestOutput, is_cumulative: bool = False) -> None:
        """One streamed output of a decoding request: its token ids are the new ones (DELTA)
        or all so far (`is_cumulative`)."""
        now = self._clock()
        num_tokens = sum(len(o.token_ids) for o in output.outputs)
        preemptions = output.metrics.num_preemptions
        last = self._last_output.get(output.request_id)
        if last is not None:
            last_time, last_tokens, last_preemptions = last
            new_tokens = num_tokens - last_tokens if is_cumulative else num_tokens
            if new_tokens > 0:
                self._decode.add(new_tokens, now - last_time)
            if preemptions > last_preemptions:
                self._preemptions.add(preemptions - last_preemptions)
        elif preemptions:
            self._preemptions.add(preemptions)
        if output.finished:
            self._last_output.pop(output.request_id, None)
        else:
            self._last_output[output.request_id] = (now, num_tokens, preemptions)

    def request_ended(self, request_id: str) -> None:
        self._last_output.pop(request_id, None)

    def prefill_tokens_per_s(self) -> float:
        tokens, busy = self._prefill.totals()
        if self._busy_since is not None:  # a prefill in flight: its time counts, its tokens not yet
            busy += self._clock() - self._busy_since
        return tokens / busy if tokens and busy > 0 else 0.0

    def tpot_s(self) -> float:
        tokens, seconds = self._decode.totals()
        return seconds / tokens if tokens else 0.0

    def report(self, stats: EngineStats, num_queued: int) -> dict[str, float]:
        preemptions, _ = self._preemptions.totals()
        return {
            WAITING_PROMPT_TOKENS: float(stats.num_waiting_prefill_tokens),
            PREFILL_TOKENS_PER_S: float(self.prefill_tokens_per_s()),
            NUM_RUNNING: float(stats.num_running),
            NUM_WAITING: float(stats.num_waiting),
            KV_USAGE: float(stats.kv_cache_usage),
            PREEMPTIONS_PER_S: float(preemptions / self._window_s),
            TPOT_S: float(self.tpot_s()),
            NUM_QUEUED: float(num_queued),
        }
