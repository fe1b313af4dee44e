"""The gateway's side of disaggregated serving: prefill on one deployment, decode on another.

The whole choreography, and who owns each part:

    gateway      DisaggregatedClient (here): prefill call -> first token streamed at once
                 -> decode call with the first token and the K/V's whereabouts
    engine       engine/api/handover.py: the `Handover` a request carries (a lease on the
                 prefill side; first tokens + remote K/V on the decode side) and the one rule
                 for whether a request continues after prefill; engine/core/kv_handover.py:
                 leases and receives in the scheduler
    workers      workers/engine_worker.py: the `prefill` and `decode` Serve methods
    transport    kv_transfer/: the connectors that move the blocks (gloo/NCCL, NIXL)
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from ..engine.api.handover import Handover, KVPath, can_disaggregate
from ..engine.api.outputs import RequestOutput
from ..gateway.engine_client import (
    ColocatedClient,
    EngineClient,
    PlacementTrace,
    answers,
    guarded,
    no_replicas,
    resume_on,
    streamed,
)
from ..router.live_replicas import LIVE_REPLICAS
from ..serving_errors import NoHealthyWorkersError
from ..worker_calls import DecodeCall, GenerateCall, WorkerModelInfo


class DisaggregatedClient(EngineClient):
    """Prefill on one deployment, decode on another, the KV cache handed over between them.

        prefill.prefill(call)  -> first token (streamed at once) + where the prompt's K/V is
        decode.decode(call, first token, K/V params) -> the rest; the decode worker fetches the
        K/V (or recomputes the prompt if the transfer fails)

    Requests that cannot be split (`can_disaggregate`: n > 1, beam search) run whole on a
    decode worker (KVPath.LOCAL), and so does every request while no prefill replica is
    live (all of them lost or restarting, or prefill scaled to zero): slower prompts, no
    refusals; and while decode is scaled to zero (it waits for decode's cold start).
    """

    def __init__(self, prefill_handle: Any, decode_handle: Any, multiplex: bool = True) -> None:
        self.prefill = prefill_handle
        self.decode = decode_handle
        self.multiplex = multiplex  # decode outputs on one channel per replica (gateway/output_channels.py)

    async def stream(self, call: GenerateCall, trace: PlacementTrace) -> AsyncIterator[RequestOutput]:
        if LIVE_REPLICAS.refuses("decode"):  # refused before any prefill work is spent on it
            raise no_replicas("decode")
        # Decode scaled to zero: the request waits for its cold start on the decode side,
        # whole, rather than holding a prefill lease that would expire meanwhile.
        if not can_disaggregate(call.params) or LIVE_REPLICAS.has_none("prefill") or LIVE_REPLICAS.has_none("decode"):
            async for output in self._whole_on_decode(call, trace):
                yield output
            return
        try:
            first = await guarded(self.prefill.prefill.remote(call), "prefill")
        except NoHealthyWorkersError:  # the last prefill replica went while this one waited
            async for output in self._whole_on_decode(call, trace):
                yield output
            return
        kv = first.kv_transfer_params
        if kv is None:  # it ended at the first token: nothing to hand over
            trace.kv_path = KVPath.PREFILL_ONLY
            trace.prefill_worker = first.worker_id
            yield first
            return
        trace.prefill_worker = kv.source_worker_id
        yield _unfinished(first)
        handover = Handover.decode(first.token_ids, kv)
        outputs = streamed(self.decode, "decode", DecodeCall(call, handover), call, "decode", self.multiplex)
        async with aclosing(outputs):
            async for output in outputs:
                trace.kv_path = output.kv_path or trace.kv_path
                trace.decode_worker = output.worker_id
                output.num_cached_tokens = first.num_cached_tokens  # the prefill side's hit is what counted
                yield output

    async def resume(
        self, call: GenerateCall, token_ids: list[int], trace: PlacementTrace
    ) -> AsyncIterator[RequestOutput]:
        async for output in resume_on(self.decode, "decode", call, token_ids, trace, self.multiplex):
            yield output

    async def _whole_on_decode(self, call: GenerateCall, trace: PlacementTrace) -> AsyncIterator[RequestOutput]:
        trace.kv_path = KVPath.LOCAL
        async for output in ColocatedClient(self.decode, "decode", self.multiplex).stream(call, trace):
            yield output

    async def model_info(self) -> WorkerModelInfo:
        return await guarded(self.decode.model_info.remote(), "decode")

    async def is_healthy(self) -> bool:
        return await answers(self.prefill) and await answers(self.decode)

    @property
    def roles(self) -> list[str]:
        return ["prefill", "decode"]


def _unfinished(output: RequestOutput) -> RequestOutput:
    """The prefill side's output as the first delta of a request that goes on."""
    completions = [dataclasses.replace(c, finish_reason=None, stop_reason=None) for c in output.outputs]
    return dataclasses.replace(output, outputs=completions, finished=False)
