"""The gateway's bound on the generation requests it holds at once, per replica
(`server.limits.max_inflight_requests`): beyond it a new one is shed at the door with
429 / RESOURCE_EXHAUSTED and Retry-After, before any of its work is done, and counted in
baton_requests_shed_total{reason="gateway_inflight"}.

    HTTP   POST /v1/completions, /v1/chat/completions: `InflightBound`, the outermost ASGI
           middleware, holds a slot for the whole response (a stream's too) and sheds before
           the body is read
    gRPC   Generate: the gateway holds a slot while the rpc streams (`InflightLimit.held`)

The bound sits below the gateway deployment's Serve `max_ongoing_requests`, so a request
over it reaches this check instead of waiting in Serve's proxy; what the proxy still queues
for a full gateway is bounded by `gateway.max_queued_requests` (Serve's 429). The count is
exported as baton_gateway_requests_in_flight, so the backlog in the gateway shows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from .. import metrics
from ..serving_errors import ServerOverloadedError

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
SHED_REASON = "gateway_inflight"
RETRY_AFTER_S = 1.0  # a slot frees when any one request ends: about a request's length


class InflightLimit:
    """Counts the generation requests in this gateway replica; refuses one over the bound."""

    def __init__(self, max_requests: int, export_metrics: bool = False) -> None:
        self.max_requests = max_requests
        self.export_metrics = export_metrics  # baton_gateway_requests_in_flight (only inside Ray)
        self.num_inflight = 0

    def enter(self) -> None:
        """Takes a slot, or raises ServerOverloadedError naming the bound (its shed reason:
        SHED_REASON); every `enter` that returns is paired with one `leave`."""
        if self.num_inflight >= self.max_requests:
            raise ServerOverloadedError(
                f"this gateway replica has {self.num_inflight} requests in flight (limit {self.max_requests}, "
                "server.limits.max_inflight_requests); retry later",
                RETRY_AFTER_S,
                SHED_REASON,
            )
        self.num_inflight += 1
        self._export()

    def leave(self) -> None:
        self.num_inflight -= 1
        self._export()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        self.enter()
        try:
            yield
        finally:
            self.leave()

    def _export(self) -> None:
        if self.export_metrics:
            metrics.record_gateway_inflight(self.num_inflight)


class InflightBound:
    """ASGI middleware: a generation request holds an `InflightLimit` slot until its response
    (a whole SSE stream included) is sent; over the bound it gets `refuse(error)`'s answer
    (the gateway's 429 in OpenAI's shape, with Retry-After) and nothing else runs."""

    def __init__(self, app: Any, limit: InflightLimit, refuse: Callable[[Exception], Any]) -> None:
        self.app = app
        self.limit = limit
        self.refuse = refuse  # logs, counts (baton_requests_shed_total) and builds the response

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        try:
            self.limit.enter()
        except ServerOverloadedError as error:
            await self.refuse(error)(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self.limit.leave()
