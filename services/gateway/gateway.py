"""The ingress deployment: gRPC `baton.v1.Inference` and the OpenAI-compatible HTTP API.

A plain class with injected dependencies and a synchronous constructor; the builder
applies `serve.ingress()` and `serve.deployment`. Ray Serve's gRPC proxy calls the
methods named like the rpcs (Generate, Tokenize, GetModelInfo, Abort, and the standard
health Check/Watch); its HTTP proxy serves the FastAPI app that `__serve_build_asgi_app__`
builds on each replica (routes are closures over the instance). Both go through one
`GenerationService`.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from baton.v1 import inference_pb2 as pb
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from .. import metrics
from ..engine.api.tokenizer import load_tokenizer
from ..serving_errors import ErrorStatus, status_of
from . import grpc_api
from .engine_client import EngineClient
from .generation import GenerationEvent, GenerationRequest, GenerationService, PreparedGeneration
from .openai_api import (
    ChatCompletionRequest,
    CompletionAccumulator,
    CompletionRequest,
    chat_logprobs,
    completion_logprobs,
    error_body,
    now,
    openai_finish_reason,
    usage_body,
)

logger = logging.getLogger(__name__)


class Gateway:
    def __init__(
        self, engine_client: EngineClient, tokenizer_path: str, mode: str = "colocated", export_metrics: bool = False
    ) -> None:
        self.mode = mode
        self.engine_client = engine_client
        self.export_metrics = export_metrics
        on_finished = _record_request if export_metrics else None
        self.service = GenerationService(load_tokenizer(tokenizer_path), engine_client, on_finished)

    # -- gRPC: baton.v1.Inference -----------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, grpc_context=None) -> AsyncIterator[pb.GenerateResponse]:  # noqa: N802
        try:
            generation = grpc_api.generation_request(request)
            num_top = generation.params.logprobs or 0
            async for event in self.service.stream(await self.service.prepare(generation)):
                yield grpc_api.generate_response(event, num_top)
        except Exception as error:  # every error becomes a status the client can read
            self._set_grpc_error(grpc_context, error)
            raise

    async def Tokenize(self, request: pb.TokenizeRequest, grpc_context=None) -> pb.TokenizeResponse:  # noqa: N802
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        ids = self.service.tokenize(request.text, add_special)
        return pb.TokenizeResponse(token_ids=ids, count=len(ids))

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, grpc_context=None) -> pb.ModelInfo:  # noqa: N802
        try:
            return grpc_api.model_info(await self.service.model_info(), self.engine_client.roles, self.mode)
        except Exception as error:
            self._set_grpc_error(grpc_context, error)
            raise

    async def Abort(self, request: pb.AbortRequest, grpc_context=None) -> pb.AbortResponse:  # noqa: N802
        return pb.AbortResponse(found=self.service.abort(request.request_id))

    # -- gRPC: grpc.health.v1.Health --------------------------------------------------

    async def Check(self, request, grpc_context=None):  # noqa: N802
        from grpc_health.v1 import health_pb2

        serving = await self.engine_client.is_healthy()
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request, grpc_context=None):  # noqa: N802
        yield await self.Check(request, grpc_context)

    # -- HTTP: OpenAI-compatible ------------------------------------------------------

    def __serve_build_asgi_app__(self) -> FastAPI:  # noqa: N807 - Ray Serve's hook name
        return build_http_app(self)

    async def list_models(self) -> dict[str, Any]:
        info = await self.service.model_info()
        card = {
            "id": info.model,
            "object": "model",
            "created": now(),
            "owned_by": "baton",
            "max_model_len": info.max_model_len,
        }
        return {"object": "list", "data": [card]}

    async def health(self):
        if not await self.engine_client.is_healthy():
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok"}

    async def completions(self, body: CompletionRequest):
        try:
            await self.service.check_model(body.model)
            prompts = body.prompts()
            params = body.sampling_params(body.max_tokens, body.logprobs)
            requests = [
                await self.service.prepare(
                    GenerationRequest(p, params, _sub_id(body.request_id, i, len(prompts)), body.cache_salt, api="http")
                )
                for i, p in enumerate(prompts)
            ]
        except Exception as error:
            return self._http_failure(error)
        response_id = f"cmpl-{uuid.uuid4().hex}"
        if body.stream:
            return await _sse(self._stream_completions(requests, params.n, response_id, body), self._http_failure)
        return await self._complete(requests, params.n, response_id, body, chat=False)

    async def chat_completions(self, body: ChatCompletionRequest):
        try:
            await self.service.check_model(body.model)
            prompt_ids = self.service.apply_chat_template(body.message_dicts())
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
            params = body.sampling_params(body.max_completion_tokens or body.max_tokens, logprobs)
            requests = [
                await self.service.prepare(
                    GenerationRequest(prompt_ids, params, body.request_id or "", body.cache_salt, api="http")
                )
            ]
        except Exception as error:
            return self._http_failure(error)
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            return await _sse(self._stream_chat(requests[0], response_id, body), self._http_failure)
        return await self._complete(requests, params.n, response_id, body, chat=True)

    # -- internals --------------------------------------------------------------------

    async def _complete(self, requests: list[PreparedGeneration], n: int, response_id: str, body, chat: bool):
        accumulator = CompletionAccumulator(len(requests) * n)
        total = None
        try:
            for i, request in enumerate(requests):
                async for event in self.service.stream(request):
                    accumulator.add(i * n + event.completion.index, event)
                    if event.finished:
                        total = _add_usage(total, event)
        except Exception as error:
            return self._http_failure(error)
        info = await self.service.model_info()
        choices = []
        for index in range(len(requests) * n):
            completion = accumulator.completion(index, requests[index // n].call.params.logprobs is not None)
            finish = openai_finish_reason(completion.finish_reason)
            if chat:
                choices.append(
                    {
                        "index": index,
                        "message": {"role": "assistant", "content": completion.text},
                        "logprobs": chat_logprobs(completion, body.top_logprobs or 0),
                        "finish_reason": finish,
                    }
                )
            else:
                choices.append(
                    {
                        "index": index,
                        "text": completion.text,
                        "finish_reason": finish,
                        "logprobs": completion_logprobs(completion, 0),
                    }
                )
        return {
            "id": response_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": now(),
            "model": info.model,
            "choices": choices,
            "usage": usage_body(total),
        }

    async def _stream_completions(self, requests, n: int, response_id: str, body) -> AsyncIterator[dict]:
        info = await self.service.model_info()
        total = None
        offsets = [0] * (len(requests) * n)
        for i, request in enumerate(requests):
            async for event in self.service.stream(request):
                index = i * n + event.completion.index
                choice = {
                    "index": index,
                    "text": event.completion.text,
                    "logprobs": completion_logprobs(event.completion, offsets[index]),
                    "finish_reason": openai_finish_reason(event.completion.finish_reason),
                }
                offsets[index] += len(event.completion.text)
                yield {
                    "id": response_id,
                    "object": "text_completion",
                    "created": now(),
                    "model": info.model,
                    "choices": [choice],
                }
                if event.finished:
                    total = _add_usage(total, event)
        if _include_usage(body):
            yield {
                "id": response_id,
                "object": "text_completion",
                "created": now(),
                "model": info.model,
                "choices": [],
                "usage": usage_body(total),
            }

    async def _stream_chat(self, request: PreparedGeneration, response_id: str, body) -> AsyncIterator[dict]:
        info = await self.service.model_info()
        base = {"id": response_id, "object": "chat.completion.chunk", "created": now(), "model": info.model}
        started: set[int] = set()
        usage = None
        async for event in self.service.stream(request):
            index = event.completion.index
            delta: dict[str, Any] = {"content": event.completion.text}
            if index not in started:
                started.add(index)
                delta["role"] = "assistant"
            choice = {
                "index": index,
                "delta": delta,
                "logprobs": chat_logprobs(event.completion, body.top_logprobs or 0),
                "finish_reason": openai_finish_reason(event.completion.finish_reason),
            }
            yield {**base, "choices": [choice]}
            if event.finished:
                usage = event.usage
        if _include_usage(body):
            yield {**base, "choices": [], "usage": usage_body(usage)}

    def _failure(self, error: Exception, api: str) -> ErrorStatus:
        status = status_of(error)
        if status.http_status >= 500:
            logger.warning("request failed: %s", status.message)
        if self.export_metrics:
            metrics.record_error(api, status.grpc_code.name)
        return status

    def _http_failure(self, error: Exception) -> JSONResponse:
        return _http_error(self._failure(error, "http"))

    def _set_grpc_error(self, grpc_context, error: Exception) -> None:
        """Sets the status on Serve's gRPC context; re-raising then keeps it (Ray wraps the
        exception with the code set here instead of reporting INTERNAL)."""
        status = self._failure(error, "grpc")
        if grpc_context is not None:
            grpc_context.set_code(status.grpc_code)
            grpc_context.set_details(status.message)


def _record_request(api: str, event: GenerationEvent) -> None:
    usage = event.usage
    metrics.record_request(
        api,
        event.completion.finish_reason or "",
        event.time_to_first_token_s,
        event.total_s,
        usage.prompt_tokens,
        usage.completion_tokens,
        usage.cached_tokens,
        event.trace.kv_path,
    )


def build_http_app(gateway: Gateway) -> FastAPI:
    """The OpenAI-compatible routes, bound to one gateway instance."""
    http = FastAPI(title="Baton", description="OpenAI-compatible API of a Baton deployment")

    @http.exception_handler(RequestValidationError)
    async def validation_error(_request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        message = f"{param}: {first.get('msg', 'invalid request')}" if param else str(error)
        return JSONResponse(error_body(message, "invalid_request_error", param, 400), status_code=400)

    @http.get("/v1/models")
    async def list_models():
        return await gateway.list_models()

    @http.get("/health")
    async def health():
        return await gateway.health()

    @http.post("/v1/completions")
    async def completions(body: CompletionRequest):
        return await gateway.completions(body)

    @http.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        return await gateway.chat_completions(body)

    return http


def _sub_id(request_id: str | None, index: int, count: int) -> str:
    if not request_id:
        return ""
    return request_id if count == 1 else f"{request_id}-{index}"


def _include_usage(body) -> bool:
    return body.stream_options is None or body.stream_options.include_usage


def _add_usage(total, event: GenerationEvent):
    if total is None:
        return event.usage
    total.prompt_tokens += event.usage.prompt_tokens
    total.completion_tokens += event.usage.completion_tokens
    total.cached_tokens += event.usage.cached_tokens
    return total


def _http_error(status: ErrorStatus) -> JSONResponse:
    return JSONResponse(
        error_body(status.message, status.openai_type, status.param, status.http_status), status_code=status.http_status
    )


async def _sse(
    events: AsyncIterator[dict], on_error: Callable[[Exception], JSONResponse]
) -> StreamingResponse | JSONResponse:
    """Server-sent events. The first event is awaited before the headers go out, so an
    error that comes at once (overload, no worker) still gets its HTTP status."""
    iterator = events.__aiter__()
    try:
        first = await iterator.__anext__()
    except StopAsyncIteration:
        first = None
    except Exception as error:
        return on_error(error)

    async def body():
        try:
            if first is not None:
                yield f"data: {json.dumps(first)}\n\n"
                async for event in iterator:
                    yield f"data: {json.dumps(event)}\n\n"
        except Exception as error:  # after the headers went out: report in the stream
            status = status_of(error)
            yield f"data: {json.dumps(error_body(status.message, status.openai_type, status.param, status.http_status))}\n\n"
        finally:
            await iterator.aclose()
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")
