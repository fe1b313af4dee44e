"""How the gateway reaches engine workers: the seam between "what to generate" and "where".

`ColocatedClient` streams from the colocated deployment (Serve picks the replica, or the
router's request router does when one is configured). `DisaggregatedClient`
(services/disaggregation: prefill, then decode) implements the same interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from ..engine.api.handover import KVPath
from ..engine.api.outputs import RequestOutput
from ..worker_calls import GenerateCall, WorkerModelInfo


@dataclass(slots=True)
class PlacementTrace:
    """Where a request ran; reported in the response's timings (proto `Timings`)."""

    kv_path: KVPath = KVPath.COLOCATED
    prefill_worker: str = ""  # worker ids; a colocated worker is both
    decode_worker: str = ""


class EngineClient(ABC):
    @abstractmethod
    def stream(self, call: GenerateCall, trace: PlacementTrace) -> AsyncIterator[RequestOutput]:
        """Outputs (deltas) of the call; closing the iterator cancels the request downstream."""

    @abstractmethod
    async def model_info(self) -> WorkerModelInfo: ...

    @abstractmethod
    async def is_healthy(self) -> bool:
        """Whether a request placed now could be served (a live round trip to the workers)."""

    @property
    @abstractmethod
    def roles(self) -> list[str]: ...


class ColocatedClient(EngineClient):
    def __init__(self, worker_handle: Any) -> None:
        self.worker = worker_handle

    async def stream(self, call: GenerateCall, trace: PlacementTrace) -> AsyncIterator[RequestOutput]:
        async with aclosing(until_finished(self.worker.options(stream=True).generate.remote(call))) as outputs:
            async for output in outputs:
                trace.decode_worker = output.worker_id
                if trace.kv_path is KVPath.COLOCATED:
                    trace.prefill_worker = output.worker_id
                yield output

    async def model_info(self) -> WorkerModelInfo:
        return await self.worker.model_info.remote()

    async def is_healthy(self) -> bool:
        return await answers(self.worker)

    @property
    def roles(self) -> list[str]:
        return ["colocated"]


async def until_finished(response: Any) -> AsyncIterator[RequestOutput]:
    """A Serve streaming response's outputs; leaving early cancels the request downstream.

    Callers iterate it under `aclosing`, so the cancel happens when they stop, not when the
    generator is collected."""
    finished = False
    try:
        async for output in response:
            finished = output.finished
            yield output
    finally:
        if not finished:
            response.cancel()


async def answers(handle: Any) -> bool:
    try:
        await handle.stats.remote()
    except Exception:  # no replica answered
        return False
    return True
