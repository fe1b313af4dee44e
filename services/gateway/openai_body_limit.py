"""The HTTP API's body-size limit: an ASGI middleware in front of every route
(`server.limits.max_request_bytes`, request_limits.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.responses import JSONResponse

from ..serving_errors import ErrorStatus, RequestTooLargeError
from .openai_protocol import error_body
from .request_limits import check_message_size


class BodySizeLimit:
    """ASGI middleware: reads the body up to `max_bytes` and hands it on, or answers 413 in
    OpenAI's error shape. The route then reads the body from memory, as it would have."""

    def __init__(self, app: Any, max_bytes: int, record_error: Callable[[Exception], ErrorStatus]) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.record_error = record_error  # the gateway's one log line and error metric

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or not _has_body(scope):
            await self.app(scope, receive, send)
            return
        try:
            declared = _content_length(scope)
            if declared is not None:
                check_message_size(declared, self.max_bytes, "request body")
            body = await self._read_body(receive)
        except RequestTooLargeError as error:
            status = self.record_error(error)
            response = JSONResponse(
                error_body(status.message, status.openai_type, None, status.http_status), status_code=status.http_status
            )
            await response(scope, receive, send)
            return
        if body is None:  # the client left before its body was in
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read_body(self, receive: Callable) -> bytes | None:
        chunks, num_bytes = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunk = message.get("body", b"")
            num_bytes += len(chunk)
            if num_bytes > self.max_bytes:
                raise RequestTooLargeError(
                    f"the request body is over the limit of {self.max_bytes} bytes (server.limits.max_request_bytes)"
                )
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive: Callable) -> Callable:
    """A `receive` that gives the buffered body once, then waits on the client (disconnect)."""
    sent = False

    async def replayed() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


def _has_body(scope: dict) -> bool:
    """HTTP/1.1: a request has a body exactly when it says Content-Length or Transfer-Encoding
    (HTTP/2 may send one with neither: counted too)."""
    if scope.get("http_version") not in ("1.0", "1.1"):
        return True
    return any(name in (b"content-length", b"transfer-encoding") for name, _ in scope["headers"])


def _content_length(scope: dict) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
