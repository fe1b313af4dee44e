"""The ingress deployment: gRPC `baton.v1.Inference` and the OpenAI-compatible HTTP API.

A plain class with injected dependencies and a synchronous constructor; the builder
applies `serve.ingress()` and `serve.deployment`. Ray Serve's gRPC proxy calls the
methods named like the rpcs (Generate, Tokenize, GetModelInfo, Abort, and the standard
health Check/Watch); its HTTP proxy serves the FastAPI app that `__serve_build_asgi_app__`
builds on each replica. Each API module owns its mapping (`grpc_api`, `openai_api`); this
class wires both onto one `GenerationService` and records their errors: a rejected request
(4xx) is one log line, a server error is logged with its traceback; clients see neither the
traceback nor internals (`serving_errors.status_of`). Every call is authenticated first
(`api_keys`: the `authorization` metadata on gRPC, the header on HTTP), health checks only
when `server.auth.protect_health` says so. Sizes are bounded before work is spent
(`request_limits`: HTTP bodies, gRPC messages, prompt text), the generation requests held
at once are bounded (`inflight_limit`: over the bound, shed with 429 at the door), and
tokenizing runs off the event loop. Overload and unavailability carry a retry delay (`retry-after` trailing metadata,
the HTTP `Retry-After` header); a cancelled request is counted as `cancelled`, not an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator

from baton.v1 import inference_pb2 as pb
from fastapi import FastAPI

from .. import metrics
from ..engine.api.tokenizer import load_tokenizer
from ..replica_ports import bind_to_node_ip
from ..serving_errors import ErrorStatus, NotFoundError, quiet_rejections, status_of
from . import grpc_api
from .admin_http import add_admin_routes
from .api_keys import ANONYMOUS, ApiKeys, Caller, grpc_authorization
from .engine_client import EngineClient
from .generation import GenerationEvent, GenerationService
from .grpc_admin import GrpcAdmin
from .inflight_limit import InflightLimit
from .openai_api import OpenAIApi, build_http_app
from .request_limits import RequestLimits
from .weight_admin import WeightAdmin

logger = logging.getLogger(__name__)


class Gateway(GrpcAdmin):
    def __init__(
        self,
        engine_client: EngineClient,
        tokenizer_path: str,
        mode: str = "colocated",
        export_metrics: bool = False,
        router: str = "power_of_two",
        api_keys: ApiKeys | None = None,
        limits: RequestLimits | None = None,
        weight_admin: WeightAdmin | None = None,
    ) -> None:
        bind_to_node_ip()
        self.mode = mode
        self.weight_admin = weight_admin  # the HTTP admin routes (admin_http.py); None: not served
        self.router = router  # how the engine replicas are chosen (reported by GetModelInfo)
        self.engine_client = engine_client
        self.export_metrics = export_metrics
        self.api_keys = api_keys if api_keys is not None else ApiKeys()  # no keys: open, as before keys
        on_finished = _record_request if export_metrics else None
        self.limits = limits if limits is not None else RequestLimits()
        inflight = InflightLimit(self.limits.max_inflight_requests, export_metrics)
        self.service = GenerationService(
            load_tokenizer(tokenizer_path), engine_client, on_finished, self.limits, inflight
        )
        self.openai = OpenAIApi(self.service, engine_client, lambda error: self._failure(error, "http"), self.api_keys)
        quiet_rejections()  # Serve's own traceback per rejected gRPC request, in this replica's log

    # -- gRPC: baton.v1.Inference -----------------------------------------------------

    async def Generate(self, request: pb.GenerateRequest, grpc_context=None) -> AsyncIterator[pb.GenerateResponse]:  # noqa: N802
        with self._grpc_errors(grpc_context), self.service.inflight.held():
            caller = self._caller(grpc_context)
            generation = grpc_api.generation_request(self._parsed(request))
            generation.owner = caller.owner
            params = generation.params
            prepared = await self.service.prepare(generation)
            prompt_ids = prepared.call.prompt_token_ids
            async for event in self.service.stream(prepared):
                yield grpc_api.generate_response(event, params.logprobs or 0, prompt_ids, params.prompt_logprobs or 0)

    async def Tokenize(self, request: pb.TokenizeRequest, grpc_context=None) -> pb.TokenizeResponse:  # noqa: N802
        with self._grpc_errors(grpc_context):
            self._caller(grpc_context)
            request = self._parsed(request)
            add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
            ids = await self.service.tokenize(request.text, add_special)
            return pb.TokenizeResponse(token_ids=ids, count=len(ids))

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, grpc_context=None) -> pb.ModelInfo:  # noqa: N802
        with self._grpc_errors(grpc_context):
            self._caller(grpc_context)
            self._parsed(request)
            return grpc_api.model_info(
                await self.service.model_info(), self.engine_client.roles, self.mode, self.router
            )

    async def Abort(self, request: pb.AbortRequest, grpc_context=None) -> pb.AbortResponse:  # noqa: N802
        """Only the key that created the request, or an admin key, aborts it; any other key
        gets `found: false`, the answer for an id that is not running."""
        with self._grpc_errors(grpc_context):
            caller = self._caller(grpc_context)
            request_id = self._parsed(request).request_id
            found = self.service.abort(request_id, caller)
            if found:
                logger.info("request %s aborted by %s", request_id, _who(caller))
            return pb.AbortResponse(found=found)

    # -- gRPC: grpc.health.v1.Health --------------------------------------------------

    async def Check(self, request, grpc_context=None):  # noqa: N802
        """SERVING / NOT_SERVING for the server ("") and the services it serves; NOT_FOUND
        for any other name, as the health protocol says."""
        from grpc_health.v1 import health_pb2

        with self._grpc_errors(grpc_context):
            if self.api_keys.protect_health:
                self._caller(grpc_context)
            service = self._parsed(request).service
            if service not in grpc_api.served_services():
                raise NotFoundError(f"service: {service!r} is not served here")
            serving = await self.engine_client.is_healthy()
            status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
            return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request, grpc_context=None):  # noqa: N802
        """One answer; an unknown service is SERVICE_UNKNOWN, as the protocol asks of Watch."""
        from grpc_health.v1 import health_pb2

        with self._grpc_errors(grpc_context):
            if self.api_keys.protect_health:
                self._caller(grpc_context)
            if self._parsed(request).service not in grpc_api.served_services():
                yield health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
                return
        yield await self.Check(request, grpc_context)

    # -- HTTP: OpenAI-compatible ------------------------------------------------------

    def __serve_build_asgi_app__(self) -> FastAPI:  # noqa: N807 - Ray Serve's hook name
        http = build_http_app(self.openai)
        if self.weight_admin is not None:
            add_admin_routes(http, self.weight_admin, self.api_keys, self.openai.error_response)
        return http

    def _parsed(self, request):
        return grpc_api.parsed(request, self.limits.max_request_bytes)

    def _caller(self, grpc_context) -> Caller:
        if not self.api_keys.is_enabled:
            return ANONYMOUS  # without keys, as before: the metadata is not read
        return self.api_keys.authenticate(grpc_authorization(grpc_context))

    def _failure(self, error: BaseException, api: str) -> ErrorStatus:
        """The client's status for `error`; logs one line for a rejection, the traceback (with
        what the client is not told: actor ids, pids, addresses) for a server error. A cancel
        (the client left, or its deadline passed) counts as finish_reason `cancelled`; a shed
        request (429, or 503 with no replica) also in baton_requests_shed_total."""
        status = status_of(error)
        if status.is_cancelled:
            logger.info("%s request cancelled", api)
        elif status.is_rejection:
            logger.info("%s request refused, %s: %s", api, status.grpc_code.name, status.message)
        else:
            logger.error("%s request failed, %s: %s", api, status.grpc_code.name, error, exc_info=error)
        if self.export_metrics:
            if status.is_cancelled:
                metrics.record_cancelled(api)
            else:
                metrics.record_error(api, status.grpc_code.name)
            if status.shed_reason is not None:
                metrics.record_shed(api, status.shed_reason)
        return status

    @contextlib.contextmanager
    def _grpc_errors(self, grpc_context) -> Iterator[None]:
        """Sets an error's status on Serve's gRPC context and re-raises: Ray then reports the
        code set here instead of INTERNAL (a streaming rpc can end with an error no other way).
        A retry delay goes in the details, where the proxy's side finds it and sends it as the
        trailing metadata `retry-after` (grpc_servicers: Serve drops a replica's trailing
        metadata on errors); it is also set here, for servers that keep it."""
        try:
            yield
        except (Exception, asyncio.CancelledError, GeneratorExit) as error:
            status = self._failure(error, "grpc")
            if grpc_context is not None:
                grpc_context.set_code(status.grpc_code)
                grpc_context.set_details(status.grpc_details)
                if status.retry_after_s is not None:
                    grpc_context.set_trailing_metadata([("retry-after", str(status.retry_after_s))])
            raise


def _who(caller: Caller) -> str:
    """A caller as logs name it: the key's fingerprint, never the key."""
    if caller.owner is None:
        return "a caller without key (the server has none)"
    return f"{'admin ' if caller.is_admin else ''}{caller.owner}"


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
