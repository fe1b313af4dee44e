"""API keys on the HTTP API: an ASGI middleware in front of every route.

A request without a valid `Authorization: Bearer <key>` gets OpenAI's error shape with 401
before any route runs, so unknown paths and FastAPI's own /docs and /openapi.json say
nothing either; /health is open unless `server.auth.protect_health`. Ray Serve's proxy
answers /-/healthz and /-/routes itself, before this app, and they stay open. The caller
reaches the routes in the request's scope (`caller_of`), where it becomes the owner of the
requests it sends.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from ..serving_errors import ErrorStatus, UnauthenticatedError
from .api_keys import ANONYMOUS, ApiKeys, Caller
from .openai_protocol import error_body

HEALTH_PATHS = frozenset({"/health"})
_CALLER = "baton.caller"  # the scope key (per request, as Starlette's own "auth" and "user")


class ApiKeyMiddleware:
    def __init__(self, app: Any, api_keys: ApiKeys, record_error: Callable[[Exception], ErrorStatus]) -> None:
        self.app = app
        self.api_keys = api_keys
        self.record_error = record_error  # the gateway's one log line and error metric

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        is_open = not self.api_keys.is_enabled or (scope["path"] in HEALTH_PATHS and not self.api_keys.protect_health)
        try:
            scope[_CALLER] = ANONYMOUS if is_open else self.api_keys.authenticate(_authorization(scope))
        except UnauthenticatedError as error:
            status = self.record_error(error)
            body = error_body(status.message, status.openai_type, None, status.http_status)
            response = JSONResponse(body, status_code=status.http_status, headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def caller_of(request: Request) -> Caller:
    """Who sent the request, as the middleware found (it runs before every route)."""
    return request.scope[_CALLER]


def _authorization(scope: dict) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            return value.decode("latin-1")
    return None
