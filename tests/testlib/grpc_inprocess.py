"""An in-process grpc.aio server with Baton's services registered the way Ray Serve's gRPC
proxy registers them (gateway/grpc_servicers.py), and an rpc's error reported as Serve's
replica reports it: the code and details the rpc set on its context before raising (grpc.aio
alone would prefix the details with the exception's class). The gateway's rpcs over a real
channel, without Ray."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator

import grpc
from baton.services.gateway.grpc_servicers import add_health_servicer_to_server, add_inference_servicer_to_server


class AsServeReports:
    """`servicer`'s rpcs; one that raises after setting a status ends with that status."""

    def __init__(self, servicer) -> None:
        self._servicer = servicer

    def __getattr__(self, name: str):
        method = getattr(self._servicer, name)
        if inspect.isasyncgenfunction(method):

            async def stream(request, context):
                try:
                    async for response in method(request, context):
                        yield response
                except Exception:
                    await _abort_as_set(context)
                    raise

            return stream

        async def unary(request, context):
            try:
                return await method(request, context)
            except Exception:
                await _abort_as_set(context)
                raise

        return unary


async def _abort_as_set(context) -> None:
    if context.code() not in (None, grpc.StatusCode.OK):
        await context.abort(context.code(), context.details() or "")


@contextlib.asynccontextmanager
async def serving(servicer, options: list[tuple[str, int]] | None = None) -> AsyncIterator[str]:
    """Serves `servicer` (a Gateway, or anything with the rpcs' methods); yields its host:port.
    `options`: grpc server options (Serve's proxy: ray.serve._private.constants.DEFAULT_GRPC_SERVER_OPTIONS)."""
    server = grpc.aio.server(options=options)
    add_inference_servicer_to_server(AsServeReports(servicer), server)
    add_health_servicer_to_server(AsServeReports(servicer), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


@contextlib.asynccontextmanager
async def served(servicer) -> AsyncIterator[grpc.aio.Channel]:
    """`serving`, and a channel to it."""
    async with serving(servicer) as address, grpc.aio.insecure_channel(address) as channel:
        yield channel
