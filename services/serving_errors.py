"""Errors of the serving layer, how each reaches a client (gRPC code, HTTP status), and how
each reaches the logs.

Engine errors are reused: InvalidRequestError (a bad parameter) and EngineDeadError (an
engine that stopped). Every error a client can see is mapped in `status_of`; its message
never carries internals (Ray actor ids, pids, node addresses, class names), which the
gateway logs instead. A request refused for the client's own reasons (4xx) is logged as one
line; `QuietRejections` keeps Ray Serve from adding a traceback for it.

Overload (429 / RESOURCE_EXHAUSTED) and no live worker (503 / UNAVAILABLE) tell the client
when to try again: `ErrorStatus.retry_after_s`, whole seconds, which the HTTP API sends as
the `Retry-After` header (and in a streamed error's body) and the gRPC API as the trailing
metadata `retry-after`. A request the client cancelled, or whose deadline passed (the proxy
cancels it either way; the gateway cannot tell the two apart), is CANCELLED / 499, counted
as finish_reason `cancelled`, never as a server error.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from dataclasses import dataclass

import grpc

from .engine.errors import EngineDeadError, InvalidRequestError

WORKER_LOST = "a worker stopped while serving this request; retrying it may succeed"
ENGINE_STOPPED = "the engine serving this request stopped after an internal error; retrying it may succeed"
CANCELLED = "the request was cancelled (the client went away or its deadline passed)"
INTERNAL_ERROR = "internal server error (the server's log has the details)"
# When a refused client may try again, unless the error says: a replica's queue drains, or a
# replica comes back, within about this long.
DEFAULT_OVERLOAD_RETRY_AFTER_S = 1.0
DEFAULT_UNAVAILABLE_RETRY_AFTER_S = 1.0
# How a gRPC status's details end when it carries a retry delay: Serve's proxy drops the
# trailing metadata a replica sets on an error, so its side (grpc_servicers) reads it here.
_RETRY_AFTER_DETAILS = re.compile(r" \(retry after (\d+) s\)$")
HTTP_CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request the client gave up on (no one reads it)
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


class RetryLaterError(RuntimeError):
    """A refusal the client may retry after `retry_after_s`; `reason` names why
    (baton_requests_shed_total's label, metrics.py). Subclasses set the defaults."""

    default_message = "retry later"
    default_retry_after_s = DEFAULT_OVERLOAD_RETRY_AFTER_S
    default_reason = "overloaded"

    def __init__(self, message: str | None = None, retry_after_s: float | None = None, reason: str | None = None):
        super().__init__(self.default_message if message is None else message)
        self.retry_after_s = self.default_retry_after_s if retry_after_s is None else retry_after_s
        self.reason = self.default_reason if reason is None else reason

    def __reduce__(self):  # Ray pickles it from the worker to the gateway
        return type(self), (str(self), self.retry_after_s, self.reason)


class ServerOverloadedError(RetryLaterError):
    """The worker's queue is over its configured bound (429)."""

    default_message = "server overloaded"


class NoHealthyWorkersError(RetryLaterError):
    """No worker can take the request right now (503)."""

    default_message = "no healthy worker"
    default_retry_after_s = DEFAULT_UNAVAILABLE_RETRY_AFTER_S
    default_reason = "no_replica"


class RequestTooLargeError(ValueError):
    """A request body or message over `server.limits.max_request_bytes` (413 /
    RESOURCE_EXHAUSTED); retrying the same request cannot help."""


class NotFoundError(LookupError):
    """An unknown model or request id (404)."""


class MalformedRequestError(ValueError):
    """The request as a whole cannot be read (not JSON, not a JSON object, not a protobuf
    message of its type): 400 / INVALID_ARGUMENT with no one field to name."""


class UnauthenticatedError(PermissionError):
    """No API key, a malformed authorization header, or a key the server does not know (401);
    the message never quotes the key."""


class PermissionDeniedError(PermissionError):
    """A known key that may not make this call: the admin calls need an admin key (403)."""


@dataclass(frozen=True, slots=True)
class ErrorStatus:
    grpc_code: grpc.StatusCode
    http_status: int
    openai_type: str
    message: str
    param: str | None = None
    retry_after_s: int | None = None  # whole seconds until a retry may succeed (Retry-After)
    shed_reason: str | None = None  # refused to keep admitted requests in bounds: which bound

    @property
    def is_rejection(self) -> bool:
        """Refused for the client's own reasons (4xx), not a failure of the server."""
        return self.http_status < 500

    @property
    def is_cancelled(self) -> bool:
        return self.grpc_code == grpc.StatusCode.CANCELLED

    @property
    def grpc_details(self) -> str:
        """The message, and the retry delay where there is one (`retry_after_of` reads it)."""
        if self.retry_after_s is None:
            return self.message
        return f"{self.message} (retry after {self.retry_after_s} s)"


def retry_after_of(details: str | bytes | None) -> int | None:
    """The retry delay in a gRPC status's details (`ErrorStatus.grpc_details`), or None."""
    if isinstance(details, bytes):
        details = details.decode("utf-8", "replace")
    found = _RETRY_AFTER_DETAILS.search(details or "")
    return int(found.group(1)) if found else None


def status_of(error: BaseException) -> ErrorStatus:
    """The client-facing status for an error raised anywhere below the gateway."""
    from ray.serve.exceptions import BackPressureError

    cause = _unwrap(error)
    if is_cancellation(cause):
        return ErrorStatus(grpc.StatusCode.CANCELLED, HTTP_CLIENT_CLOSED_REQUEST, "cancelled", CANCELLED)
    if is_worker_lost(cause):
        return ErrorStatus(grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable", WORKER_LOST)
    if isinstance(cause, InvalidRequestError):
        return ErrorStatus(grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error", str(cause), cause.field)
    if isinstance(cause, MalformedRequestError):
        return ErrorStatus(grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error", str(cause))
    if isinstance(cause, RequestTooLargeError):
        return ErrorStatus(grpc.StatusCode.RESOURCE_EXHAUSTED, 413, "invalid_request_error", str(cause))
    if isinstance(cause, ServerOverloadedError | BackPressureError):
        retry_after_s = getattr(cause, "retry_after_s", None) or DEFAULT_OVERLOAD_RETRY_AFTER_S  # Serve's: or None
        message = str(cause) or "server overloaded"
        reason = getattr(cause, "reason", "queue")  # Serve's BackPressureError: its handle queue
        return ErrorStatus(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            429,
            "rate_limit_error",
            message,
            None,
            whole_seconds(retry_after_s),
            reason,
        )
    if isinstance(cause, EngineDeadError):
        return ErrorStatus(grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable", ENGINE_STOPPED)
    if isinstance(cause, NoHealthyWorkersError):
        retry_after_s = whole_seconds(cause.retry_after_s)
        return ErrorStatus(
            grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable", str(cause), None, retry_after_s, cause.reason
        )
    if isinstance(cause, UnauthenticatedError):
        return ErrorStatus(grpc.StatusCode.UNAUTHENTICATED, 401, "invalid_request_error", str(cause))
    if isinstance(cause, PermissionDeniedError):
        return ErrorStatus(grpc.StatusCode.PERMISSION_DENIED, 403, "permission_error", str(cause))
    if isinstance(cause, NotFoundError):
        return ErrorStatus(grpc.StatusCode.NOT_FOUND, 404, "not_found_error", str(cause))
    if isinstance(cause, TimeoutError):
        return ErrorStatus(grpc.StatusCode.DEADLINE_EXCEEDED, 504, "timeout", str(cause) or "request timed out")
    # A server error's own text can hold internals (paths, ids, reprs): the log has it, with its traceback.
    return ErrorStatus(grpc.StatusCode.INTERNAL, 500, "internal_error", INTERNAL_ERROR)


def is_worker_lost(error: BaseException) -> bool:
    """Whether `error` says the worker's process (or node) is gone, rather than refusing."""
    from ray.exceptions import NodeDiedError, ObjectLostError, RayActorError, WorkerCrashedError

    lost = RayActorError | WorkerCrashedError | NodeDiedError | ObjectLostError
    return isinstance(error, lost) or isinstance(_unwrap(error), lost)


def is_cancellation(error: BaseException) -> bool:
    """The request was cancelled from outside: the client went away or its deadline passed
    (Serve's proxy cancels the replica's call; a downstream call then ends cancelled too)."""
    from ray.exceptions import TaskCancelledError  # Serve's RequestCancelledError is one

    return isinstance(error, asyncio.CancelledError | GeneratorExit | TaskCancelledError)


def whole_seconds(seconds: float) -> int:
    """A Retry-After value: HTTP's delay-seconds is a whole number, at least 1 here."""
    return max(1, math.ceil(seconds))


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
