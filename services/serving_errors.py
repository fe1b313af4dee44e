"""Errors of the serving layer, how each reaches a client (gRPC code, HTTP status), and how
each reaches the logs.

Engine errors are reused: InvalidRequestError (a bad parameter) and EngineDeadError (an
engine that stopped). Every error a client can see is mapped in `status_of`; its message
never carries internals (Ray actor ids, pids, node addresses, class names), which the
gateway logs instead. A request refused for the client's own reasons (4xx) is logged as one
line; `QuietRejections` keeps Ray Serve from adding a traceback for it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from .engine.errors import EngineDeadError, InvalidRequestError

WORKER_LOST = "a worker stopped while serving this request; retrying it may succeed"
ENGINE_STOPPED = "the engine serving this request stopped after an internal error; retrying it may succeed"
# The codes of requests refused for what the client sent or how much: no traceback in the logs.
REJECTION_CODES = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.CANCELLED,
    }
)


class ServerOverloadedError(RuntimeError):
    """The worker's queue is over its configured bound; retry later (429)."""


class NoHealthyWorkersError(RuntimeError):
    """No worker can take the request right now (503)."""


class NotFoundError(LookupError):
    """An unknown model or request id (404)."""


class MalformedRequestError(ValueError):
    """The request as a whole cannot be read (not JSON, not a JSON object, not a protobuf
    message of its type): 400 / INVALID_ARGUMENT with no one field to name."""


class UnauthenticatedError(PermissionError):
    """No API key, a malformed authorization header, or a key the server does not know (401);
    the message never quotes the key."""


@dataclass(frozen=True, slots=True)
class ErrorStatus:
    grpc_code: grpc.StatusCode
    http_status: int
    openai_type: str
    message: str
    param: str | None = None

    @property
    def is_rejection(self) -> bool:
        """Refused for the client's own reasons (4xx), not a failure of the server."""
        return self.http_status < 500


def status_of(error: BaseException) -> ErrorStatus:
    """The client-facing status for an error raised anywhere below the gateway."""
    from ray.exceptions import NodeDiedError, ObjectLostError, RayActorError, WorkerCrashedError
    from ray.serve.exceptions import BackPressureError

    cause = _unwrap(error)
    if isinstance(cause, RayActorError | WorkerCrashedError | NodeDiedError | ObjectLostError):
        return ErrorStatus(grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable", WORKER_LOST)
    if isinstance(cause, InvalidRequestError):
        return ErrorStatus(grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error", str(cause), cause.field)
    if isinstance(cause, MalformedRequestError):
        return ErrorStatus(grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error", str(cause))
    if isinstance(cause, ServerOverloadedError | BackPressureError):
        return ErrorStatus(
            grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error", str(cause) or "server overloaded"
        )
    if isinstance(cause, EngineDeadError):
        return ErrorStatus(grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable", ENGINE_STOPPED)
    if isinstance(cause, NoHealthyWorkersError):
        return ErrorStatus(grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable", str(cause))
    if isinstance(cause, UnauthenticatedError):
        return ErrorStatus(grpc.StatusCode.UNAUTHENTICATED, 401, "invalid_request_error", str(cause))
    if isinstance(cause, NotFoundError):
        return ErrorStatus(grpc.StatusCode.NOT_FOUND, 404, "not_found_error", str(cause))
    if isinstance(cause, TimeoutError):
        return ErrorStatus(grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout", str(cause) or "request timed out")
    return ErrorStatus(grpc.StatusCode.INTERNAL, 500, "internal_error", str(cause) or "internal server error")


def is_rejection(error: BaseException) -> bool:
    """True for an error that refuses a request for the client's own reasons. Ray Serve's
    gRPCStatusError (also inside a RayTaskError) carries the code the gateway set."""
    code = getattr(error, "grpc_code", None)
    if isinstance(code, grpc.StatusCode):
        return code in REJECTION_CODES
    original = getattr(error, "original_exception", None)
    return status_of(original if isinstance(original, BaseException) else error).is_rejection


class QuietRejections(logging.Filter):
    """Drops Ray Serve's "Request failed." records (each a full traceback, in the replica's
    and the proxy's logs) for rejected requests; server errors keep theirs."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is None:
            return True
        try:
            return not is_rejection(error)
        except Exception:  # a filter must never lose a record it cannot judge
            return True


def quiet_rejections() -> None:
    """Installs `QuietRejections` on Ray Serve's logger in this process, once."""
    serve_logger = logging.getLogger("ray.serve")
    if not any(isinstance(f, QuietRejections) for f in serve_logger.filters):
        serve_logger.addFilter(QuietRejections())


def _unwrap(error: BaseException) -> BaseException:
    """Ray wraps a remote exception in RayTaskError, which also subclasses the cause's type;
    the cause itself carries the original message."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) else error
