"""How the gateway reaches engine workers: the seam between "what to generate" and "where".

`ColocatedPlacement` streams from the colocated deployment (Serve picks the replica, or the
router's request router does when one is configured). The disaggregated placement
(prefill, then decode) implements the same interface.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from ..engine.outputs import RequestOutput
from ..workers.messages import DecodeCall, GenerateCall, WorkerModelInfo


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
        async with aclosing(_until_finished(self.worker.options(stream=True).generate.remote(call))) as outputs:
            async for output in outputs:
                yield output

    async def model_info(self) -> WorkerModelInfo:
        return await self.worker.model_info.remote()

    async def is_healthy(self) -> bool:
        return await _answers(self.worker)

    @property
    def roles(self) -> list[str]:
        return ["colocated"]


class DisaggregatedPlacement(Placement):
    """Prefill on one deployment, decode on another, the KV cache handed over between them.

        prefill.prefill(call)  -> first token (streamed at once) + where the prompt's K/V is
        decode.decode(call, first token, K/V params) -> the rest; the decode worker fetches the
        K/V (or recomputes the prompt if the transfer fails)

    Requests with n > 1 or beam search run whole on a decode worker (kv_path "local").
    """

    def __init__(self, prefill_handle: Any, decode_handle: Any) -> None:
        self.prefill = prefill_handle
        self.decode = decode_handle

    async def stream(self, call: GenerateCall, trace: PlacementTrace) -> AsyncIterator[RequestOutput]:
        if call.params.n > 1 or call.params.use_beam_search:
            trace.kv_path = "local"
            async for output in ColocatedPlacement(self.decode).stream(call, trace):
                yield output
            return
        first = await self.prefill.prefill.remote(call)
        kv = first.kv_transfer_params
        if kv is None:  # it ended at the first token: nothing to hand over
            trace.kv_path = "prefill-only"
            yield first
            return
        trace.prefill_worker = kv.source_worker_id
        yield _unfinished(first)
        response = self.decode.options(stream=True).decode.remote(DecodeCall(call, first.token_ids, kv))
        async with aclosing(_until_finished(response)) as outputs:
            async for output in outputs:
                trace.kv_path = output.kv_path or trace.kv_path
                output.num_cached_tokens = first.num_cached_tokens  # the prefill side's hit is what counted
                yield output

    async def model_info(self) -> WorkerModelInfo:
        return await self.decode.model_info.remote()

    async def is_healthy(self) -> bool:
        return await _answers(self.prefill) and await _answers(self.decode)

    @property
    def roles(self) -> list[str]:
        return ["prefill", "decode"]


async def _until_finished(response: Any) -> AsyncIterator[RequestOutput]:
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


async def _answers(handle: Any) -> bool:
    try:
        await handle.stats.remote()
    except Exception:  # no replica answered
        return False
    return True


def _unfinished(output: RequestOutput) -> RequestOutput:
    """The prefill side's output as the first delta of a request that goes on."""
    completions = [dataclasses.replace(c, finish_reason=None, stop_reason=None) for c in output.outputs]
    return dataclasses.replace(output, outputs=completions, finished=False)
