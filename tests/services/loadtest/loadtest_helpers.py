"""Shared test pieces: hand-made request records and a fake in-process backend."""

from __future__ import annotations

import asyncio
import time

import grpc
from baton.services.loadtest.backends.base import Backend, BenchRequest, SamplingOptions, ServerInfo
from baton.services.loadtest.records import RequestRecord, Response, Usage
from baton.v1 import inference_pb2 as pb
from baton.v1 import inference_pb2_grpc as pb_grpc

# Every aggregate a run's "metrics" holds in the result file.
METRIC_KEYS = {
    "num_requests", "num_completed", "num_failed", "num_good", "duration_s", "request_throughput",
    "output_token_throughput", "total_token_throughput", "goodput", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms",
    "server_ttft_ms", "dispatch_lag_ms", "prompt_tokens", "output_tokens", "cached_tokens", "cached_token_ratio",
    "token_check", "kv_paths", "errors",
}  # fmt: skip


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


class FakeInference(pb_grpc.InferenceServicer):
    """A stand-in Baton: 4 output tokens in 3 deltas (one of two tokens), usage and timings last;
    max_tokens 99 is refused with RESOURCE_EXHAUSTED."""

    def __init__(self) -> None:
        self.num_generated = 0  # Generate calls seen

    async def GetModelInfo(self, request, context):  # noqa: N802
        return pb.ModelInfo(model="tiny", max_context_length=256, block_size=16, vocab_size=1000, mode="colocated")

    async def Tokenize(self, request, context):  # noqa: N802
        ids = list(range(len(request.text.split()) + (1 if request.add_special_tokens else 0)))
        return pb.TokenizeResponse(token_ids=ids, count=len(ids))

    async def Generate(self, request, context):  # noqa: N802
        self.num_generated += 1
        if request.sampling.max_tokens == 99:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many requests")
        yield pb.GenerateResponse(token_ids=[5], text="a")
        await asyncio.sleep(0.01)
        yield pb.GenerateResponse(token_ids=[6, 7], text="bc")  # a two-token delta
        await asyncio.sleep(0.01)
        last = pb.GenerateResponse(token_ids=[8], text="d", finish_reason="length")
        last.usage.CopyFrom(pb.Usage(prompt_tokens=len(request.token_ids.ids), completion_tokens=4, cached_tokens=16))
        last.timings.CopyFrom(pb.Timings(time_to_first_token_s=0.005, total_s=0.03, kv_path="colocated"))
        yield last


def with_grpc_server(test, servicer=None):
    """Runs `await test(address)` against an in-process gRPC server (FakeInference by default)."""

    async def main():
        server = grpc.aio.server()
        pb_grpc.add_InferenceServicer_to_server(servicer or FakeInference(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            await test(f"127.0.0.1:{port}")
        finally:
            await server.stop(None)

    asyncio.run(main())
