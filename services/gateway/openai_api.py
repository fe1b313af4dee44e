"""The OpenAI-compatible HTTP API mapped onto the generation service: /v1/completions and
/v1/chat/completions (whole or as server-sent events), /v1/models, /health, and the
FastAPI app that routes them, behind `openai_auth`'s API-key check. The request shapes and
body helpers are in `openai_protocol`; a forced tool call's output is read back into
`tool_calls` by `tool_calls`' parsers. Bodies over `server.limits.max_request_bytes` get a 413
before any route runs (`openai_body_limit`). A refusal with a retry delay (429, 503) sets
`Retry-After`; one that comes after a stream started says `retry_after` in the error event.
A request whose client went away is counted as cancelled (the gateway's `_failure`).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from ..serving_errors import ErrorStatus
from .api_keys import ApiKeys
from .completion_choices import CompletionChoices
from .engine_client import EngineClient
from .generation import GenerationEvent, GenerationRequest, GenerationService, PreparedGeneration, Usage
from .inflight_limit import InflightBound
from .openai_auth import ApiKeyMiddleware, caller_of
from .openai_body_limit import BodySizeLimit
from .openai_errors import body_error, check_strings, unreadable_body
from .openai_protocol import (
    ChatCompletionRequest,
    CompletionAccumulator,
    CompletionRequest,
    chat_logprobs,
    error_body,
    now,
    openai_finish_reason,
    usage_body,
)
from .token_bytes import TokenBytes
from .tool_calls import ForcedToolCall, ToolCallParser


@dataclass(slots=True)
class OpenAIApi:
    service: GenerationService
    engine_client: EngineClient
    record_error: Callable[[Exception], ErrorStatus]  # the gateway's logging and metrics for a failed request
    api_keys: ApiKeys = field(default_factory=ApiKeys)  # no keys: open
    token_bytes: TokenBytes = field(init=False)  # chat logprobs' `bytes`

    def __post_init__(self) -> None:
        self.token_bytes = TokenBytes(self.service.tokenizer)

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

    async def completions(self, body: CompletionRequest, owner: str | None = None):
        try:
            check_strings(body)
            await self.service.check_model(body.model)
            body.check_supported()
            prompts = body.prompts()
            constraint = body.constraint()
            params = body.completion_params(constraint)
            requests = [
                await self.service.prepare(
                    GenerationRequest(
                        p,
                        params,
                        _sub_id(body.request_id, i, len(prompts)),
                        body.cache_salt,
                        body.add_special_tokens,
                        api="http",
                        constraint_field=constraint.field if constraint else None,
                        owner=owner,
                    ),
                )
                for i, p in enumerate(prompts)
            ]
        except asyncio.CancelledError as error:
            self.record_error(error)
            raise
        except Exception as error:
            return self.error_response(error)
        response_id = f"cmpl-{uuid.uuid4().hex}"
        choices = CompletionChoices.build(body, prompts, [r.call for r in requests], self.service.tokenizer)
        if body.stream:
            return await _sse(self._stream_completions(requests, choices, response_id, body), self.record_error)
        return await self._complete(requests, params.n, response_id, body, chat=False, completion_choices=choices)

    async def chat_completions(self, body: ChatCompletionRequest, owner: str | None = None):
        try:
            check_strings(body)
            await self.service.check_model(body.model)
            body.check_supported()
            forced_call = body.forced_tool_call()
            constraint = body.constraint(forced_call)
            prompt_ids = await self.service.apply_chat_template(body.message_dicts(), body.tool_dicts(forced_call))
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
            # Unset, chat may generate to the end of the context, as OpenAI's and vLLM's do.
            max_tokens = body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
            params = body.sampling_params(max_tokens, logprobs, constraint)
            request = GenerationRequest(
                prompt_ids,
                params,
                body.request_id or "",
                body.cache_salt,
                api="http",
                constraint_field=constraint.field if constraint else None,
                owner=owner,
            )
            requests = [await self.service.prepare(request)]
        except asyncio.CancelledError as error:
            self.record_error(error)
            raise
        except Exception as error:
            return self.error_response(error)
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            chunks = self._stream_chat(requests[0], response_id, body, forced_call)
            return await _sse(chunks, self.record_error)
        return await self._complete(requests, params.n, response_id, body, chat=True, forced_call=forced_call)

    # -- internals --------------------------------------------------------------------

    async def _complete(
        self,
        requests: list[PreparedGeneration],
        n: int,
        response_id: str,
        body,
        chat: bool,
        forced_call: ForcedToolCall | None = None,
        completion_choices: CompletionChoices | None = None,
    ):
        accumulator = CompletionAccumulator(len(requests) * n)
        total, weight_version = None, None
        try:
            for i, request in enumerate(requests):
                async for event in self.service.stream(request):
                    accumulator.add(i * n + event.completion.index, event)
                    if completion_choices is not None:
                        completion_choices.note(i, event)
                    if event.finished:
                        total = _add_usage(total, event)
                        weight_version = event.trace.weight_version
        except asyncio.CancelledError as error:
            self.record_error(error)
            raise
        except Exception as error:
            return self.error_response(error)
        info = await self.service.model_info()
        choices = []
        for index in range(len(requests) * n):
            completion = accumulator.completion(index, requests[index // n].call.params.logprobs is not None)
            finish = openai_finish_reason(completion.finish_reason, forced_call is not None)
            if chat:
                choice = {
                    "index": index,
                    "message": _chat_message(completion.text, forced_call),
                    "logprobs": chat_logprobs(completion, body.top_logprobs or 0, self.token_bytes),
                    "finish_reason": finish,
                }
                if body.return_token_ids:
                    choice["token_ids"] = list(completion.token_ids)
            else:
                choice = completion_choices.whole(index, completion)
            choices.append(choice)
        return {
            "id": response_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": now(),
            "model": info.model,
            "choices": choices,
            "usage": usage_body(total),
            "weight_version": weight_version,  # Baton's: the weights that produced it (RL rollouts)
        }

    async def _stream_completions(
        self, requests, choices: CompletionChoices, response_id: str, body
    ) -> AsyncIterator[dict]:
        info = await self.service.model_info()
        total = None
        for i, request in enumerate(requests):
            async for event in self.service.stream(request):
                choice = choices.streamed(i, event)
                chunk = {
                    "id": response_id,
                    "object": "text_completion",
                    "created": now(),
                    "model": info.model,
                    "choices": [choice],
                }
                if event.finished:
                    chunk["weight_version"] = event.trace.weight_version
                yield chunk
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

    async def _stream_chat(
        self, request: PreparedGeneration, response_id: str, body, forced_call: ForcedToolCall | None
    ) -> AsyncIterator[dict]:
        info = await self.service.model_info()
        base = {"id": response_id, "object": "chat.completion.chunk", "created": now(), "model": info.model}
        started: set[int] = set()
        parsers: dict[int, ToolCallParser] = {}  # per choice, for forced tool calls
        usage = None
        async for event in self.service.stream(request):
            completion = event.completion
            index = completion.index
            if forced_call is None:
                deltas = [{"content": completion.text}]
            else:  # one chunk per tool-call delta: the call's id and name, then argument text
                parser = parsers.setdefault(index, forced_call.parser())
                deltas = [{"tool_calls": [entry]} for entry in parser.feed(completion.text)]
            finish = openai_finish_reason(completion.finish_reason, forced_call is not None)
            logprobs = chat_logprobs(completion, body.top_logprobs or 0, self.token_bytes)
            if not deltas and (finish is not None or logprobs is not None):
                deltas = [{}]
            for i, delta in enumerate(deltas):
                if index not in started:
                    started.add(index)
                    delta = {"role": "assistant", **({"content": None} if forced_call else {}), **delta}
                is_last = i == len(deltas) - 1
                choice = {
                    "index": index,
                    "delta": delta,
                    "logprobs": logprobs if is_last else None,
                    "finish_reason": finish if is_last else None,
                }
                if body.return_token_ids:  # the event's tokens go with its last chunk
                    choice["token_ids"] = list(completion.token_ids) if is_last else []
                if event.finished and is_last:
                    yield {**base, "choices": [choice], "weight_version": event.trace.weight_version}
                else:
                    yield {**base, "choices": [choice]}
            if event.finished:
                usage = event.usage
        if _include_usage(body):
            yield {**base, "choices": [], "usage": usage_body(usage)}

    def error_response(self, error: Exception) -> JSONResponse:
        return _status_response(self.record_error(error))


# FastAPI's detail when the body is no text JSON can read (bytes that are not UTF-8, say).
FASTAPI_UNREADABLE_BODY = "There was an error parsing the body"
_BODY_MODELS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}


def build_http_app(api: OpenAIApi) -> FastAPI:
    """The OpenAI-compatible routes, bound to one API instance (one per replica)."""
    # No redirect from a path with a trailing slash: a 307 without a body is no error OpenAI clients read.
    http = FastAPI(title="Baton", description="OpenAI-compatible API of a Baton deployment", redirect_slashes=False)
    http.add_middleware(ApiKeyMiddleware, api_keys=api.api_keys, record_error=api.record_error)
    # Added later, so it runs earlier: a body over the limit costs no more than its counting,
    # and a request over the in-flight bound is shed before its body is read.
    max_bytes = api.service.limits.max_request_bytes
    http.add_middleware(BodySizeLimit, max_bytes=max_bytes, record_error=api.record_error)
    http.add_middleware(InflightBound, limit=api.service.inflight, refuse=api.error_response)

    @http.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        return api.error_response(body_error(error, _BODY_MODELS.get(request.url.path)))

    @http.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        """Unknown paths, wrong methods, unreadable bodies: OpenAI's shape, like every error."""
        where = f"{request.method} {request.url.path}"
        message = {404: f"{where} does not exist", 405: f"{where}: method not allowed"}.get(
            error.status_code,
            unreadable_body(error.__cause__) if error.detail == FASTAPI_UNREADABLE_BODY else str(error.detail),
        )
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        body = error_body(message, kind if error.status_code < 500 else "internal_error", None, error.status_code)
        return JSONResponse(body, status_code=error.status_code, headers=error.headers)

    @http.get("/v1/models")
    async def list_models():
        return await api.list_models()

    @http.get("/health")
    async def health():
        return await api.health()

    @http.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await api.completions(body, caller_of(request).owner)

    @http.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await api.chat_completions(body, caller_of(request).owner)

    return http


def _chat_message(text: str, forced_call: ForcedToolCall | None) -> dict[str, Any]:
    if forced_call is None:
        return {"role": "assistant", "content": text}
    parser = forced_call.parser()
    parser.feed(text)
    return {"role": "assistant", "content": None, "tool_calls": parser.tool_calls()}


def _sub_id(request_id: str | None, index: int, count: int) -> str:
    if not request_id:
        return ""
    return request_id if count == 1 else f"{request_id}-{index}"


def _include_usage(body) -> bool:
    """The usage chunk comes only when asked for, as OpenAI defines `include_usage`."""
    return body.stream_options is not None and body.stream_options.include_usage


def _add_usage(total: Usage | None, event: GenerationEvent) -> Usage:
    if total is None:
        return event.usage
    total.prompt_tokens += event.usage.prompt_tokens
    total.completion_tokens += event.usage.completion_tokens
    total.cached_tokens += event.usage.cached_tokens
    return total


def _status_body(status: ErrorStatus) -> dict[str, Any]:
    body = error_body(status.message, status.openai_type, status.param, status.http_status)
    if status.retry_after_s is not None:  # a stream's error event has no headers to carry it
        body["error"]["retry_after"] = status.retry_after_s
    return body


def _status_response(status: ErrorStatus) -> JSONResponse:
    headers = None if status.retry_after_s is None else {"Retry-After": str(status.retry_after_s)}
    return JSONResponse(_status_body(status), status_code=status.http_status, headers=headers)


async def _sse(
    events: AsyncIterator[dict], record_error: Callable[[Exception], ErrorStatus]
) -> StreamingResponse | JSONResponse:
    """Server-sent events. The first event is awaited before the headers go out, so an
    error that comes at once (overload, no worker) still gets its HTTP status."""
    iterator = events.__aiter__()
    try:
        first = await iterator.__anext__()
    except StopAsyncIteration:
        first = None
    except asyncio.CancelledError as error:
        record_error(error)
        raise
    except Exception as error:
        return _status_response(record_error(error))

    async def body():
        try:
            if first is not None:
                yield f"data: {json.dumps(first)}\n\n"
                async for event in iterator:
                    yield f"data: {json.dumps(event)}\n\n"
        except (asyncio.CancelledError, GeneratorExit) as error:  # the client left mid-stream
            record_error(error)
            raise
        except Exception as error:  # after the headers went out: report in the stream
            yield f"data: {json.dumps(_status_body(record_error(error)))}\n\n"
        finally:
            await iterator.aclose()
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")
