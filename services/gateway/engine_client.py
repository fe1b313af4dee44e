"""How the gateway reaches engine workers: the seam between "what to generate" and "where".

`ColocatedClient` streams from the colocated deployment (Serve picks the replica, or the
router's request router does when one is configured). `DisaggregatedClient`
(services/disaggregation: prefill, then decode) implements the same interface.

A call waits for its first answer only while its deployment has a live replica
(`guarded`, reading router/live_replicas.py): with none, Serve would queue it until one is
back, and the client would hang; it gets NoHealthyWorkersError (503, Retry-After) instead.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, TypeVar

from ..engine.api.handover import Handover, KVPath
from ..engine.api.outputs import RequestOutput
from ..router.live_replicas import LIVE_REPLICAS
from ..serving_errors import NoHealthyWorkersError
from ..worker_calls import DecodeCall, GenerateCall, WorkerModelInfo

T = TypeVar("T")
LIVENESS_POLL_S = 0.05  # how often a call waiting for its first answer looks at the replica set
RETRY_AFTER_S = 5  # what a 503 for a role without replicas suggests: about a replica's restart


@dataclass(slots=True)
class PlacementTrace:
    """Where a request ran; reported in the response's timings (proto `Timings`)."""

    kv_path: KVPath = KVPath.COLOCATED
    prefill_worker: str = ""  # worker ids; a colocated worker is both
    decode_worker: str = ""
    weight_version: str | None = None  # of the latest output (RL rollouts: the weights it came from)


class EngineClient(ABC):
    @abstractmethod
    def stream(self, call: GenerateCall, trace: PlacementTrace) -> AsyncIterator[RequestOutput]:
        """Outputs (deltas) of the call; closing the iterator cancels the request downstream."""

    @abstractmethod
    def resume(self, call: GenerateCall, token_ids: list[int], trace: PlacementTrace) -> AsyncIterator[RequestOutput]:
        """Continues `call` on a live worker after its own was lost with `token_ids` streamed
        (one sample): the outputs after them."""

    @abstractmethod
    async def model_info(self) -> WorkerModelInfo: ...

    @abstractmethod
    async def is_healthy(self) -> bool:
        """Whether a request placed now could be served (a live round trip to the workers)."""

    @property
    @abstractmethod
    def roles(self) -> list[str]: ...


class ColocatedClient(EngineClient):
    def __init__(self, worker_handle: Any, role: str = "colocated") -> None:
        self.worker = worker_handle
        self.role = role  # the deployment's role (a disaggregated client runs n > 1 on "decode")

    async def stream(self, call: GenerateCall, trace: PlacementTrace) -> AsyncIterator[RequestOutput]:
        response = self.worker.options(stream=True).generate.remote(call)
        async with aclosing(until_finished(response, self.role)) as outputs:
            async for output in outputs:
                trace.decode_worker = output.worker_id
                if trace.kv_path is KVPath.COLOCATED:
                    trace.prefill_worker = output.worker_id
                yield output

    async def resume(
        self, call: GenerateCall, token_ids: list[int], trace: PlacementTrace
    ) -> AsyncIterator[RequestOutput]:
        async for output in resume_on(self.worker, self.role, call, token_ids, trace):
            yield output

    async def model_info(self) -> WorkerModelInfo:
        return await self.worker.model_info.remote()

    async def is_healthy(self) -> bool:
        return await answers(self.worker)

    @property
    def roles(self) -> list[str]:
        return ["colocated"]


async def resume_on(
    handle: Any, role: str, call: GenerateCall, token_ids: list[int], trace: PlacementTrace
) -> AsyncIterator[RequestOutput]:
    """The rest of a migrated request, recomputed on a replica of `handle` (Handover.resume)."""
    response = handle.options(stream=True).decode.remote(DecodeCall(call, Handover.resume(token_ids)))
    async with aclosing(until_finished(response, role)) as outputs:
        async for output in outputs:
            trace.kv_path = KVPath.MIGRATED
            trace.decode_worker = output.worker_id
            yield output


async def until_finished(response: Any, role: str) -> AsyncIterator[RequestOutput]:
    """A Serve streaming response's outputs; leaving early cancels the request downstream.
    The first output is `guarded`: `role` losing its last replica ends the wait.

    Callers iterate it under `aclosing`, so the cancel happens when they stop, not when the
    generator is collected."""
    finished = False
    outputs = response.__aiter__()
    try:
        output = await guarded(outputs.__anext__(), role)
        while True:
            finished = output.finished
            yield output
            output = await outputs.__anext__()
    except StopAsyncIteration:
        return
    finally:
        if not finished:
            response.cancel()


async def guarded(first_answer: Awaitable[T], role: str) -> T:
    """`first_answer`, unless `role` has no live replica before it comes: then the call is
    cancelled and NoHealthyWorkersError raised (Serve would hold it until a replica is back)."""
    if LIVE_REPLICAS.has_none(role):
        _close(first_answer)
        raise no_replicas(role)
    task = asyncio.ensure_future(first_answer)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=LIVENESS_POLL_S)
            if done:
                return task.result()
            if LIVE_REPLICAS.has_none(role):
                raise no_replicas(role)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def no_replicas(role: str) -> NoHealthyWorkersError:
    return NoHealthyWorkersError(f"no {role} replica is running right now", retry_after_s=RETRY_AFTER_S)


def _close(awaitable: Awaitable) -> None:
    close = getattr(awaitable, "close", None)  # a coroutine never awaited warns unless closed
    if close is not None:
        close()


async def answers(handle: Any) -> bool:
    try:
        await handle.stats.remote()
    except Exception:  # no replica answered
        return False
    return True
