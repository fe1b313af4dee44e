"""How the gateway reaches engine workers: the seam between "what to generate" and "where".

`ColocatedPlacement` streams from the colocated deployment (Serve picks the replica, or the
router's request router does when one is configured). The disaggregated placement
(prefill, then decode) implements the same interface.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ..engine.outputs import RequestOutput
from ..workers.messages import GenerateCall, WorkerModelInfo


@dataclass(slots=True)
class PlacementTrace:
    """Where a request ran; reported in the response's timings."""

    kv_path: str = "colocated"  # "colocated" | "transferred" | "recomputed"
    prefill_worker: str = ""
    decode_worker: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


class Placement(ABC):
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


class ColocatedPlacement(Placement):
    def __init__(self, worker_handle: Any) -> None:
        self.worker = worker_handle

    async def stream(self, call: GenerateCall, trace: PlacementTrace) -> AsyncIterator[RequestOutput]:
        response = self.worker.options(stream=True).generate.remote(call)
        finished = False
        try:
            async for output in response:
                finished = output.finished
                yield output
        finally:
            if not finished:
                response.cancel()

    async def model_info(self) -> WorkerModelInfo:
        return await self.worker.model_info.remote()

    async def is_healthy(self) -> bool:
        try:
            await self.worker.stats.remote()
        except Exception:  # no replica answered
            return False
        return True

    @property
    def roles(self) -> list[str]:
        return ["colocated"]
