"""Errors of the serving layer, and how each reaches a client (gRPC code, HTTP status).

Engine errors are reused: InvalidRequestError (a bad parameter) and EngineDeadError (an
engine that stopped). Every error a client can see is mapped in `status_of`.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from .engine.errors import EngineDeadError, InvalidRequestError


class ServerOverloadedError(RuntimeError):
    """The worker's queue is over its configured bound; retry later (429)."""


class NoHealthyWorkersError(RuntimeError):
    """No worker can take the request right now (503)."""


class NotFoundError(LookupError):
    """An unknown model or request id (404)."""


@dataclass(frozen=True, slots=True)
class ErrorStatus:
    grpc_code: grpc.StatusCode
    http_status: int
    openai_type: str
    message: str
    param: str | None = None


def status_of(error: BaseException) -> ErrorStatus:
    """The client-facing status for an error raised anywhere below the gateway."""
    from ray.exceptions import RayActorError  # the gateway runs in Ray anyway
    from ray.serve.exceptions import BackPressureError

    cause = _unwrap(error)
    if isinstance(cause, RayActorError):
        return ErrorStatus(grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable", f"the worker died: {cause}")
    if isinstance(cause, InvalidRequestError):
        return ErrorStatus(grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error", str(cause), cause.field)
    if isinstance(cause, ServerOverloadedError | BackPressureError):
        return ErrorStatus(
            grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error", str(cause) or "server overloaded"
        )
    if isinstance(cause, NoHealthyWorkersError | EngineDeadError):
        return ErrorStatus(grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable", str(cause))
    if isinstance(cause, NotFoundError):
        return ErrorStatus(grpc.StatusCode.NOT_FOUND, 404, "not_found_error", str(cause))
    if isinstance(cause, TimeoutError):
        return ErrorStatus(grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout", str(cause) or "request timed out")
    return ErrorStatus(grpc.StatusCode.INTERNAL, 500, "internal_error", f"{type(cause).__name__}: {cause}")


def _unwrap(error: BaseException) -> BaseException:
    """Ray wraps a remote exception in RayTaskError, which also subclasses the cause's type;
    the cause itself carries the original message."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) else error
