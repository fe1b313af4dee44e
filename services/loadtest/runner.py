"""The open-loop dispatcher: sessions start when the arrival process says, whatever is in flight.

    t0 ----a0----a1--a2-------a3----- ... (arrival offsets, seconds after t0)
           |     |   |        |
           S0    S1  S2       S3       each a task: its turns run one after another

Open loop: a session is started at its arrival time even if earlier ones have not finished,
so a slow server shows up as growing latency, not as a lower offered rate. The optional
concurrency cap (`max_concurrency`) holds a slot per in-flight request: with rate = inf
this is the closed-loop fixed-concurrency mode; with a finite rate, arrivals wait for a
slot (and that wait counts in their latency, since TTFT is timed from the send).

Bounds: at most `num_requests` requests (turns) are sent, and none is started after
`duration_s`; requests in flight at the bound finish and are counted. The run's duration
is from t0 to the end of the last request. A request's `scheduled_s` is when it was due
(its arrival, or for a later turn the end of the previous one plus the think time);
`start_s - scheduled_s` is the client's dispatch lag.
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from dataclasses import dataclass

from . import seeding
from .arrivals import ArrivalProcess
from .backends.base import Backend, BenchRequest
from .errors import BenchInputError
from .records import RequestRecord, Response
from .workloads.base import Session, Turn, Workload


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """One load level of a run (one point of a sweep)."""

    rate: float = math.inf  # session arrivals per second
    burstiness: float = 1.0  # gamma shape of the gaps; 1 = Poisson
    max_concurrency: int | None = None  # requests in flight at most; None: unbounded

    def __post_init__(self) -> None:
        ArrivalProcess(self.rate, self.burstiness)  # validates
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise BenchInputError(f"max concurrency must be >= 1, got {self.max_concurrency}")

    @property
    def arrivals(self) -> ArrivalProcess:
        return ArrivalProcess(self.rate, self.burstiness)

    def label(self) -> str:
        if math.isinf(self.rate):
            return f"concurrency {self.max_concurrency}" if self.max_concurrency else "all at once"
        label = f"{self.rate:g} req/s"
        if self.burstiness != 1.0:
            label += f" (burstiness {self.burstiness:g})"
        if self.max_concurrency:
            label += f", max {self.max_concurrency} in flight"
        return label


@dataclass(frozen=True, slots=True)
class Bounds:
    num_requests: int | None = None  # requests (turns) sent at most
    duration_s: float | None = None  # no request is started after this

    def __post_init__(self) -> None:
        if self.num_requests is None and self.duration_s is None:
            raise BenchInputError("bound the run: give a request count, a duration, or both")
        if self.num_requests is not None and self.num_requests < 1:
            raise BenchInputError(f"request count must be >= 1, got {self.num_requests}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise BenchInputError(f"duration must be > 0, got {self.duration_s}")


@dataclass(slots=True)
class RunOutcome:
    load: LoadSpec
    records: list[RequestRecord]  # in completion order
    duration_s: float  # t0 to the end of the last request
    host_load: tuple[float, float] = (0.0, 0.0)  # this machine's 1-minute load average at start and end


class LoadRunner:
    def __init__(
        self,
        backend: Backend,
        workload: Workload,
        load: LoadSpec,
        bounds: Bounds,
        seed: int = 0,
        run: int = 0,
        progress=None,  # anything with update(n), e.g. a tqdm bar
    ) -> None:
        if math.isinf(load.rate) and load.max_concurrency is None and bounds.num_requests is None:
            raise BenchInputError("with an unbounded rate and no concurrency cap, give a request count")
        self.backend = backend
        self.workload = workload
        self.load = load
        self.bounds = bounds
        self.seed = seed
        self.run_index = run
        self.progress = progress
        self.records: list[RequestRecord] = []
        self._slots = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
        self._num_reserved = 0  # requests promised to started sessions
        self._num_sent = 0
        self._t0 = 0.0

    async def run(self) -> RunOutcome:
        offsets = self.load.arrivals.offsets(
            seeding.rng(self.seed, seeding.ARRIVALS)
        )  # one pattern, scaled by the rate
        tasks: list[asyncio.Task] = []
        load_at_start = os.getloadavg()[0]  # a busy machine (other jobs beside the server) skews latencies
        self._t0 = time.perf_counter()
        for index, offset in enumerate(offsets):
            if self._budget_left() == 0 or self._past_duration(offset):
                break
            session = self.workload.session(self.seed, self.run_index, index)  # built before its time comes
            delay = self._t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if self._slots is not None:
                await self._slots.acquire()
                if self._past_duration(self._elapsed()):
                    self._slots.release()
                    break
            turns = session.turns[: self._budget_left()]
            self._num_reserved += len(turns)
            tasks.append(asyncio.create_task(self._run_session(index, session, turns, offset)))
        await asyncio.gather(*tasks)
        end = max((r.start_s + r.response.end_s for r in self.records), default=0.0)
        return RunOutcome(self.load, self.records, end, (load_at_start, os.getloadavg()[0]))

    async def _run_session(self, session_id: int, session: Session, turns: list[Turn], arrival: float) -> None:
        context: list[int] = []
        reply: list[int] = []
        scheduled = arrival
        for k, turn in enumerate(turns):
            if k > 0:  # the first turn's slot was taken by the dispatcher
                if session.think_time_s:
                    await asyncio.sleep(session.think_time_s)
                scheduled = self._elapsed()
                if self._past_duration(scheduled):
                    return
                if self._slots is not None:
                    await self._slots.acquire()
            request = BenchRequest(turn.max_tokens, prompt_text=turn.text)
            if turn.new_token_ids is not None:
                context = context + reply + turn.new_token_ids
                request.prompt_token_ids = context
            index = self._num_sent
            self._num_sent += 1
            try:
                response = await self.backend.send(request)
            except Exception as error:  # a backend bug must not hang the run: record it as a failure
                response = Response(sent_at=time.perf_counter(), error=f"{type(error).__name__}: {error}")
            finally:
                if self._slots is not None:
                    self._slots.release()
            prompt_tokens = len(context) if turn.new_token_ids is not None else turn.num_text_tokens
            self.records.append(
                RequestRecord(
                    index=index,
                    session_id=session_id,
                    turn=k,
                    group=turn.group or session.group,
                    scheduled_s=scheduled,
                    start_s=response.sent_at - self._t0,
                    prompt_tokens=prompt_tokens,
                    max_tokens=turn.max_tokens,
                    response=response,
                )
            )
            if self.progress is not None:
                self.progress.update(1)
            if response.error is not None:
                return  # a conversation does not go on after a failed turn
            reply = response.output_token_ids or []

    def _elapsed(self) -> float:
        return time.perf_counter() - self._t0

    def _budget_left(self) -> int:
        if self.bounds.num_requests is None:
            return 1 << 62
        return self.bounds.num_requests - self._num_reserved

    def _past_duration(self, t: float) -> bool:
        return self.bounds.duration_s is not None and t >= self.bounds.duration_s
