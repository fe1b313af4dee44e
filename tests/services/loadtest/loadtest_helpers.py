"""Shared test pieces: hand-made request records and a fake in-process backend."""

from __future__ import annotations

import asyncio
import time

from baton.services.loadtest.backends.base import Backend, BenchRequest, SamplingOptions, ServerInfo
from baton.services.loadtest.records import RequestRecord, Response, Usage


def record(
    chunk_times: list[float],
    end: float,
    *,
    chunk_tokens: list[int] | None = None,
    usage: Usage | None = None,
    error: str | None = None,
    group: str = "g",
    prompt_tokens: int | None = 100,
    index: int = 0,
    scheduled: float = 0.0,
    start: float = 0.0,
) -> RequestRecord:
    response = Response(
        sent_at=0.0,
        chunk_times_s=list(chunk_times),
        chunk_num_tokens=chunk_tokens or [1] * len(chunk_times),
        end_s=end,
        usage=usage,
        error=error,
    )
    return RequestRecord(index, index, 0, group, scheduled, start, prompt_tokens, 16, response)


class FakeBackend(Backend):
    """Answers every request after `service_s`, streaming `max_tokens` one-token chunks; each
    reply's token ids are 10000 + the request's number, so a test can follow a conversation."""

    kind = "fake"

    def __init__(self, service_s: float = 0.02, fail_if=None) -> None:
        super().__init__("fake", SamplingOptions(), 10.0, 1.0)
        self.service_s = service_s
        self.fail_if = fail_if  # request -> bool: answer it with an error
        self.sent: list[tuple[float, BenchRequest]] = []  # (perf_counter at send, request)
        self.in_flight = 0
        self.max_in_flight = 0

    async def probe(self, model):
        return ServerInfo("fake-model", 4096, 1000)

    @property
    def returns_reply_token_ids(self) -> bool:
        return True

    async def send(self, request: BenchRequest) -> Response:
        number = len(self.sent)
        response = Response(sent_at=time.perf_counter())
        self.sent.append((response.sent_at, request))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.service_s)
            if self.fail_if is not None and self.fail_if(request):
                response.error = "UNAVAILABLE: injected"
                return response
            n = request.max_tokens
            now = time.perf_counter() - response.sent_at
            response.chunk_times_s = [now + i * 1e-4 for i in range(n)]
            response.chunk_num_tokens = [1] * n
            response.output_token_ids = [10000 + number] * n
            prompt = len(request.prompt_token_ids or [])
            response.usage = Usage(prompt, n, 0)
            response.end_s = response.chunk_times_s[-1]
            return response
        finally:
            self.in_flight -= 1
