"""Baton's gRPC API (`baton.v1.Inference/Generate`, server streaming) as a benchmark backend.

Prompts go as token ids when the workload has them (used as is by the server, so prompt
lengths are exact) or as text. Each streamed message carries new token ids; the last one
carries usage (prompt, completion and cached tokens) and the server's own timings (TTFT,
KV path, workers), all recorded. Requests are spread over a few channels so one HTTP/2
connection's stream limit does not cap concurrency. Every call sends the
`("application", NAME)` metadata Ray Serve routes on and, with an API key,
`("authorization", "Bearer KEY")`.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import grpc
from baton.v1 import inference_pb2 as pb
from baton.v1 import inference_pb2_grpc as pb_grpc

from ...client_tls import ClientTLS
from ..errors import BenchInputError
from ..records import Response, Usage
from .base import Backend, BenchRequest, SamplingOptions, ServerInfo, unreachable

_COUNT_CONCURRENCY = 32  # Tokenize calls in flight while counting a dataset


class GrpcBackend(Backend):
    kind = "grpc"

    def __init__(
        self,
        address: str,
        sampling: SamplingOptions | None = None,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        tokenizer: Any = None,
        application: str = "baton",
        num_channels: int = 4,
        api_key: str | None = None,
        tls: ClientTLS | None = None,
    ) -> None:
        super().__init__(address, sampling or SamplingOptions(), timeout_s, connect_timeout_s, tokenizer)
        self.tls = tls
        self.metadata = (("application", application),)
        if api_key:
            self.metadata += (("authorization", f"Bearer {api_key}"),)
        self.application = application
        self.num_channels = num_channels
        self._channels: list[grpc.aio.Channel] = []
        self._stubs: list[pb_grpc.InferenceStub] = []
        self._next_stub = itertools.count()

    def _stub(self) -> pb_grpc.InferenceStub:
        if not self._stubs:  # grpc.aio channels belong to the running event loop: made on first use
            self._channels = [self._channel() for _ in range(self.num_channels)]
            self._stubs = [pb_grpc.InferenceStub(c) for c in self._channels]
        return self._stubs[next(self._next_stub) % len(self._stubs)]

    def _channel(self) -> grpc.aio.Channel:
        if self.tls is None:
            return grpc.aio.insecure_channel(self.address)
        return grpc.aio.secure_channel(self.address, self.tls.grpc_credentials())

    async def probe(self, model: str | None) -> ServerInfo:
        stub = self._stub()
        try:
            await asyncio.wait_for(self._channels[0].channel_ready(), self.connect_timeout_s)
        except TimeoutError:
            raise unreachable(
                "Baton gRPC",
                self.address,
                f"no connection within {self.connect_timeout_s:g} s",
                "Is `baton serve` running, and is this its gRPC port?",
            ) from None
        try:
            info = await stub.GetModelInfo(
                pb.GetModelInfoRequest(), metadata=self.metadata, timeout=self.connect_timeout_s
            )
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                raise BenchInputError(
                    f"the gRPC server at {self.address} refused the call: {e.details()} (--api-key or $BATON_API_KEY)"
                ) from e
            raise BenchInputError(
                f"the gRPC server at {self.address} did not answer baton.v1.Inference/GetModelInfo for application "
                f"{self.application!r} ({e.code().name}: {e.details()}). Check --application (the Serve application "
                "name) and that this is a Baton server (for other servers use --backend openai)"
            ) from e
        if model is not None and model != info.model:
            raise BenchInputError(f"the server at {self.address} serves model {info.model!r}, not {model!r}")
        details = {"mode": info.mode, "block_size": info.block_size, "roles": list(info.roles)}
        return ServerInfo(info.model, info.max_context_length or None, info.vocab_size or None, details)

    @property
    def returns_reply_token_ids(self) -> bool:
        return True

    @property
    def can_count_tokens(self) -> bool:
        return True  # the server's Tokenize rpc

    async def count_tokens(self, texts: list[str], add_special_tokens: bool) -> list[int] | None:
        if self.tokenizer is not None:
            return await super().count_tokens(texts, add_special_tokens)
        gate = asyncio.Semaphore(_COUNT_CONCURRENCY)

        async def count(text: str) -> int:
            async with gate:
                request = pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
                return (await self._stub().Tokenize(request, metadata=self.metadata, timeout=self.timeout_s)).count

        try:
            return list(await asyncio.gather(*(count(t) for t in texts)))
        except grpc.aio.AioRpcError as e:
            raise BenchInputError(f"Tokenize failed on {self.address}: {e.code().name}: {e.details()}") from e

    async def send(self, request: BenchRequest) -> Response:
        sampling = pb.SamplingParameters(
            max_tokens=request.max_tokens, temperature=self.sampling.temperature, ignore_eos=self.sampling.ignore_eos
        )
        message = pb.GenerateRequest(sampling=sampling)
        if request.prompt_token_ids is not None:
            message.token_ids.ids.extend(request.prompt_token_ids)
        else:
            message.text = request.prompt_text or ""
        stub = self._stub()
        token_ids: list[int] = []
        texts: list[str] = []
        response = Response(sent_at=time.perf_counter())
        try:
            async for delta in stub.Generate(message, metadata=self.metadata, timeout=self.timeout_s):
                now = time.perf_counter() - response.sent_at
                if delta.token_ids:
                    response.chunk_times_s.append(now)
                    response.chunk_num_tokens.append(len(delta.token_ids))
                    token_ids.extend(delta.token_ids)
                    texts.append(delta.text)
                if delta.finish_reason:
                    response.finish_reason = delta.finish_reason
                if delta.HasField("usage"):
                    usage = delta.usage
                    response.usage = Usage(usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)
                if delta.HasField("timings"):
                    timings = delta.timings
                    response.server_ttft_s = timings.time_to_first_token_s
                    response.kv_path = timings.kv_path
                    response.prefill_worker = timings.prefill_worker
                    response.decode_worker = timings.decode_worker
        except grpc.aio.AioRpcError as e:
            response.error = f"{e.code().name}: {e.details()}"
        response.end_s = time.perf_counter() - response.sent_at
        if response.error is None and not response.chunk_times_s:
            response.error = "the stream ended without output"
        response.output_token_ids = token_ids
        response.output_text = "".join(texts)
        return response

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()
        self._channels, self._stubs = [], []
