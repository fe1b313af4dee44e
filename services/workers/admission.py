"""Admission control on an engine replica: admit a request only if it can start soon.

Every call that reaches a replica is judged here, before the engine sees it:

    queued      admitted requests that have not produced their first output yet (prefill
                side: the first token; decode side: the first token after the handover)
    start rate  first outputs per second while requests were queued: over the last
                `window_s`, counted from when the queue last became non-empty
    slots       where a started request holds its place in the batch until it ends (colocated
                and decode replicas, `max_running` given): when each running request frees
                its slot, from the mean run time of the requests that ended lately
    wait        the longest of queued / start rate (how long the queue takes to drain), the
                time until enough slots free for the queue and this request (a full batch
                that does not free), and the age of the oldest queued request (a queue that
                is not draining at all)

The rate counts only the current backlog's starts because starts seen while nothing waited
measure the arrivals, not the capacity: a replica that started one request 2.5 s before a
burst of 16 would otherwise have put the burst's 13th request at 12 / 0.4 per s = 30 s and
shed it. Until the backlog has started two requests there is no rate.

The slots count because starts come in waves where requests are alike: a full batch that
started together also ends together, so right after a wave of starts the rate says "soon"
while no slot frees for a whole run time. With max_num_seqs 8 and 160-token requests at 3x
capacity, the rate alone admitted requests that then waited 3-4 s against a 1 s bound. The
slot estimate takes each running request to end at the mean run time of those that ended
lately (an EOS's early ends included); with mixed lengths that is a rough guess, and since
the wait is the longest of the estimates, it errs toward shedding.

A request is shed (ServerOverloadedError: 429 / RESOURCE_EXHAUSTED with Retry-After) when
  - `wait` is over `max_queue_delay_s`: admitted requests then start within about that
    long, so their TTFT stays near it under any overload instead of growing with the backlog;
  - the queued requests reach `max_waiting_requests`, or the engine's waiting prompt tokens
    would pass `max_waiting_prompt_tokens` (bounds that hold even while the rate estimate is
    new).
Retry-After is the estimated wait beyond the bound, at least a second.

The replica's Serve `max_ongoing_requests` is set above what the engine holds (running +
waiting), so the backlog reaches this check and shows in the engine's gauges; what Serve
still queues in a caller's handle is bounded by `max_queued_requests` (Serve's
BackPressureError, also a 429).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ..engine.stats import EngineStats
from ..serving_errors import ServerOverloadedError

RUN_TIMES_KEPT = 32  # the mean run time is over the requests that ended last


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    max_waiting_requests: int = 512
    max_waiting_prompt_tokens: int | None = None  # None: no token bound
    max_queue_delay_s: float | None = None  # None: no delay bound
    window_s: float = 5.0  # how far back the start rate looks


class Admission:
    def __init__(
        self, limits: AdmissionLimits, clock: Callable[[], float] = time.monotonic, max_running: int | None = None
    ) -> None:
        """`max_running`: the engine's batch slots (max_num_seqs) where a started request holds
        one until it ends; None where it does not (a prefill replica hands it on at once)."""
        self.limits = limits
        self._clock = clock
        self._max_running = max_running
        self._queued: dict[str, float] = {}  # request id -> when admitted (insertion order: oldest first)
        self._starts: deque[float] = deque()  # first outputs of the current backlog, within the window
        self._busy_since: float | None = None  # when the queue last became non-empty
        self._running: dict[str, float] = {}  # started, not ended: request id -> when it started
        self._run_times: deque[float] = deque(maxlen=RUN_TIMES_KEPT)  # start to end, of the last ended
        self.num_shed = 0

    @property
    def num_queued(self) -> int:
        return len(self._queued)

    def admit(self, request_id: str, num_prompt_tokens: int, stats: EngineStats, worker_id: str) -> None:
        """Admits `request_id` or raises ServerOverloadedError naming the bound it would pass."""
        limits = self.limits
        if self.num_queued >= limits.max_waiting_requests:
            self._shed(
                f"worker {worker_id} has {self.num_queued} requests waiting to start "
                f"(limit {limits.max_waiting_requests})",
                1.0,
                "waiting_requests",
            )
        tokens = limits.max_waiting_prompt_tokens
        if (
            tokens is not None
            and stats.num_waiting_prefill_tokens
            and stats.num_waiting_prefill_tokens + num_prompt_tokens > tokens
        ):
            self._shed(
                f"worker {worker_id} has {stats.num_waiting_prefill_tokens} prompt tokens waiting "
                f"(limit {tokens}, this request adds {num_prompt_tokens})",
                1.0,
                "waiting_tokens",
            )
        if limits.max_queue_delay_s is not None:
            wait = self.estimated_wait_s()
            if wait > limits.max_queue_delay_s:
                self._shed(
                    f"worker {worker_id} would start this request in about {wait:.1f} s "
                    f"(limit {limits.max_queue_delay_s:g} s)",
                    wait - limits.max_queue_delay_s,
                    "queue_delay",
                )
        now = self._clock()
        if not self._queued:
            self._busy_since = now
        self._queued[request_id] = now

    def started(self, request_id: str) -> None:
        """Its first output came: it left the queue."""
        if self._queued.pop(request_id, None) is not None:
            now = self._clock()
            self._starts.append(now)
            if self._max_running is not None:
                self._running[request_id] = now
            self._maybe_idle()

    def left(self, request_id: str) -> None:
        """It ended, finished or cancelled, before or after its first output."""
        if self._queued.pop(request_id, None) is not None:
            self._maybe_idle()
        elif (start := self._running.pop(request_id, None)) is not None:
            self._run_times.append(self._clock() - start)

    def _maybe_idle(self) -> None:
        if not self._queued:  # the backlog is gone: its rate says nothing about the next one
            self._busy_since = None
            self._starts.clear()

    def estimated_wait_s(self) -> float:
        """How long a request that arrives now would wait to start."""
        now = self._clock()
        if not self._queued:  # a full batch still makes it wait for a slot
            return self._slot_wait_s(now)
        since = max(now - self.limits.window_s, self._busy_since if self._busy_since is not None else now)
        while self._starts and self._starts[0] < since:
            self._starts.popleft()
        oldest_age = now - next(iter(self._queued.values()))
        wait = max(oldest_age, self._slot_wait_s(now))
        if len(self._starts) < 2:
            return wait
        rate = len(self._starts) / max(now - since, 1e-3)
        return max(len(self._queued) / rate, wait)

    def _slot_wait_s(self, now: float) -> float:
        """When a slot frees for the next request to arrive, behind the queued ones: each
        queued request takes the earliest slot to free, and then holds it a mean run time.
        0 without slots or before any request has ended (no run time yet)."""
        if self._max_running is None or not self._run_times:
            return 0.0
        run_time = sum(self._run_times) / len(self._run_times)
        ends = sorted(max(0.0, start + run_time - now) for start in self._running.values())
        ends = [0.0] * max(0, self._max_running - len(ends)) + ends[: self._max_running]  # free slots first
        place = len(self._queued)  # the queued requests go first, one slot each
        return ends[place % len(ends)] + (place // len(ends)) * run_time

    def _shed(self, message: str, retry_after_s: float, reason: str) -> None:
        """`reason` names the bound: baton_requests_shed_total's label (services/metrics.py)."""
        self.num_shed += 1
        raise ServerOverloadedError(f"{message}; retry later", max(1.0, math.ceil(retry_after_s)), reason)
