"""The admin routes of the HTTP API (names as SGLang's), for RL rollouts:

    POST /update_weights_from_disk   {"model_path": DIR, "weight_version": "v7"?, "pause_mode"?}:
                                      all or nothing (weight_admin.py): 400 naming each replica
                                      that refused the folder, 500 naming each that failed
    GET  /weight_update_ranks        {"num_engine_ranks": N, ...}: a trainer's group has N + 1
    POST /init_weights_update_group  {"master_address", "master_port", "world_size", "group_name"?,
                                      "backend"?, "rank_offset"?}: every replica joins (the
                                      trainer, rank 0, joins at the same time)
    POST /update_weights_from_distributed  {"names", "dtypes", "shapes", "weight_version"?,
                                      "group_name"?}: every replica receives the trainer's
                                      broadcast (engine/execution/weight_sync.py's buckets)
    POST /destroy_weights_update_group {"group_name"?}
    POST /pause_generation           {"mode": "abort" | "wait" | "keep"}
    POST /continue_generation
    POST /reset_prefix_cache
    POST /sleep                      {"level": 1 | 2}
    POST /wake_up
    GET  /weight_version             {"weight_version": ..., "replicas": {worker id: version}}

Each applies to every engine replica (gateway/weight_admin.py). With API keys configured,
only an admin key may call them (403 for another key); without keys the server is open, as
for every other route.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from ..serving_errors import PermissionDeniedError
from .api_keys import ApiKeys
from .openai_auth import caller_of
from .weight_admin import DEFAULT_GROUP, DEFAULT_UPDATE_PAUSE, WeightAdmin


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class UpdateFromDisk(_Body):
    model_path: str = Field(min_length=1, description="A Hugging Face folder every replica can read")
    weight_version: str | None = Field(None, description="The new version's name (default: a counter)")
    pause_mode: str = Field(DEFAULT_UPDATE_PAUSE, description="The fleet's pause across the update: abort, wait, keep")


class InitGroup(_Body):
    master_address: str
    master_port: int = Field(gt=0, lt=65536)
    world_size: int = Field(ge=2, description="The trainer (rank 0) and every engine rank")
    group_name: str = DEFAULT_GROUP
    backend: str = "gloo"
    rank_offset: int = Field(1, ge=1, description="The first engine rank (the trainer holds those before)")


class UpdateFromDistributed(_Body):
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    weight_version: str | None = None
    group_name: str = DEFAULT_GROUP


class GroupName(_Body):
    group_name: str = DEFAULT_GROUP


class Pause(_Body):
    mode: str = "abort"


class Sleep(_Body):
    level: int = 1


def add_admin_routes(
    http: FastAPI, admin: WeightAdmin, api_keys: ApiKeys, error_response: Callable[[Exception], JSONResponse]
) -> None:
    async def run(request: Request, call: Callable[[], Awaitable[Any]]) -> Any:
        try:
            if api_keys.is_enabled and not caller_of(request).is_admin:
                raise PermissionDeniedError(f"{request.url.path} needs an admin key")
            return await call()
        except Exception as error:
            return error_response(error)

    @http.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateFromDisk, request: Request):
        async def call():
            result = await admin.update_weights_from_disk(body.model_path, body.weight_version, body.pause_mode)
            answer = {
                "success": result.ok,
                "weight_version": result.weight_version,
                "updated": result.updated,
                "failed": result.failed,
            }
            return JSONResponse(answer, status_code=200 if result.ok else 500)

        return await run(request, call)

    @http.get("/weight_update_ranks")
    async def weight_update_ranks(request: Request):
        async def call():
            ranks = await admin.weight_update_ranks()
            return {"num_engine_ranks": sum(ranks.values()), "replicas": ranks}

        return await run(request, call)

    @http.post("/init_weights_update_group")
    async def init_weights_update_group(body: InitGroup, request: Request):
        async def call():
            offsets = await admin.init_weights_update_group(
                body.master_address, body.master_port, body.world_size, body.group_name, body.backend, body.rank_offset
            )
            return {"success": True, "rank_offsets": offsets}

        return await run(request, call)

    @http.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(body: UpdateFromDistributed, request: Request):
        async def call():
            result = await admin.update_weights_from_distributed(
                body.names, body.dtypes, body.shapes, body.weight_version, body.group_name
            )
            answer = {"success": result.ok, "weight_version": result.weight_version, "updated": result.updated}
            return JSONResponse({**answer, "failed": result.failed}, status_code=200 if result.ok else 500)

        return await run(request, call)

    @http.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(body: GroupName, request: Request):
        return await run(request, lambda: _done(admin.destroy_weights_update_group(body.group_name)))

    @http.post("/pause_generation")
    async def pause_generation(body: Pause, request: Request):
        return await run(request, lambda: _done(admin.pause_generation(body.mode)))

    @http.post("/continue_generation")
    async def continue_generation(request: Request):
        return await run(request, lambda: _done(admin.continue_generation()))

    @http.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request):
        return await run(request, lambda: _done(admin.reset_prefix_cache()))

    @http.post("/sleep")
    async def sleep(body: Sleep, request: Request):
        return await run(request, lambda: _done(admin.sleep(body.level)))

    @http.post("/wake_up")
    async def wake_up(request: Request):
        return await run(request, lambda: _done(admin.wake_up()))

    @http.get("/weight_version")
    async def weight_version(request: Request):
        async def call():
            replicas = await admin.weight_versions()
            versions = set(replicas.values())
            return {"weight_version": versions.pop() if len(versions) == 1 else None, "replicas": replicas}

        return await run(request, call)


async def _done(call: Awaitable[list[str]]) -> dict[str, Any]:
    return {"success": True, "replicas": await call}
