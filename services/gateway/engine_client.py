"""How the gateway reaches engine workers: the seam between "what to generate" and "where".

`ColocatedClient` streams from the colocated deployment (Serve picks the replica, or the
router's request router does when one is configured). `DisaggregatedClient`
(services/disaggregation: prefill, then decode) implements the same interface.

A call waits for its first answer only while its deployment has a live replica
(`guarded`, reading router/live_replicas.py): with none, Serve would queue it until one is
back, and the client would hang; it gets NoHealthyWorkersError (503, Retry-After) instead.
A role configured to scale to zero is waited for, bounded by its cold-start timeout.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, TypeVar

from ..engine.api.handover import Handover, KVPath
from ..engine.api.outputs import RequestOutput
from ..router.live_replicas import LIVE_REPLICAS
from ..serving_errors import NoHealthyWorkersError
from ..worker_calls import ChannelOffer, DecodeCall, GenerateCall, MovedToChannel, WorkerModelInfo
from .output_channels import Channels

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
    def __init__(self, worker_handle: Any, role: str = "colocated", multiplex: bool = True) -> None:
        self.worker = worker_handle
        self.role = role  # the deployment's role (a disaggregated client runs n > 1 on "decode")
        self.multiplex = multiplex  # outputs on one channel per replica (gateway/output_channels.py)

    async def stream(self, call: GenerateCall, trace: PlacementTrace) -> AsyncIterator[RequestOutput]:
        outputs = streamed(self.worker, "generate", call, call, self.role, self.multiplex)
        async with aclosing(outputs):
            async for output in outputs:
                trace.decode_worker = output.worker_id
                if trace.kv_path is KVPath.COLOCATED:
                    trace.prefill_worker = output.worker_id
                yield output

    async def resume(
        self, call: GenerateCall, token_ids: list[int], trace: PlacementTrace
    ) -> AsyncIterator[RequestOutput]:
        async for output in resume_on(self.worker, self.role, call, token_ids, trace, self.multiplex):
            yield output

    async def model_info(self) -> WorkerModelInfo:
        return await guarded(self.worker.model_info.remote(), self.role)

    async def is_healthy(self) -> bool:
        return await answers(self.worker)

    @property
    def roles(self) -> list[str]:
        return ["colocated"]


async def resume_on(
    handle: Any, role: str, call: GenerateCall, token_ids: list[int], trace: PlacementTrace, multiplex: bool = True
) -> AsyncIterator[RequestOutput]:
    """The rest of a migrated request, recomputed on a replica of `handle` (Handover.resume)."""
    outputs = streamed(handle, "decode", DecodeCall(call, Handover.resume(token_ids)), call, role, multiplex)
    async with aclosing(outputs):
        async for output in outputs:
            trace.kv_path = KVPath.MIGRATED
            trace.decode_worker = output.worker_id
            yield output


_CHANNELS: Channels | None = None  # this process's (a gateway replica's), made in its event loop
_LOCAL_SOCKETS = True  # gateway.local_output_sockets


def use_local_sockets(enabled: bool) -> None:
    """Whether this process's channels to replicas on its node take a Unix socket (set before
    the first request)."""
    global _LOCAL_SOCKETS
    _LOCAL_SOCKETS = enabled


def channels() -> Channels:
    global _CHANNELS
    if _CHANNELS is None:
        _CHANNELS = Channels(node=None if _LOCAL_SOCKETS else "")
    return _CHANNELS


async def streamed(
    handle: Any, method: str, argument: Any, call: GenerateCall, role: str, multiplex: bool
) -> AsyncIterator[RequestOutput]:
    """The outputs of a streaming `method` call on `handle`'s deployment; with `multiplex`, they
    move onto this gateway's channel to the replica that took the call (output_channels.py).
    Callers iterate it under `aclosing` (leaving cancels the request downstream)."""
    if not multiplex:
        response = getattr(handle.options(stream=True), method).remote(argument)
        async with aclosing(until_finished(response, role)) as outputs:
            async for output in outputs:
                yield output
        return
    hub = channels()
    queue, started = hub.register(call.request_id)
    try:
        call.channel = hub.channel_id
        response = getattr(handle.options(stream=True), method).remote(argument)
        on_channel = lambda replica, call_stream: hub.follow(queue, call_stream, replica)  # noqa: E731
        offered = lambda replica: hub.offered(replica, handle)  # noqa: E731
        async with aclosing(until_finished(response, role, offered, on_channel, started)) as outputs:
            async for output in outputs:
                yield output
    finally:
        call.channel = None
        hub.unregister(call.request_id)


async def until_finished(
    response: Any, role: str, offered: Any = None, on_channel: Any = None, started: asyncio.Future | None = None
) -> AsyncIterator[RequestOutput]:
    """A Serve streaming response's outputs; leaving early cancels the request downstream.
    The first answer is `guarded`: `role` losing its last replica ends the wait.

    A ChannelOffer on the stream goes to `offered(replica)`; after MovedToChannel the outputs
    are `on_channel(replica, rest of the stream)`'s (gateway/output_channels.py). `started`
    set (the replica announced the request on the channel, with nothing of it on this
    stream) moves there at once, without waiting for the marker to come on this stream.

    Callers iterate it under `aclosing`, so the cancel happens when they stop, not when the
    generator is collected."""
    finished = False
    items = response.__aiter__()
    # The next item as a task only while `started` may still win the race: the first answer,
    # and markers before any output; after that each item is awaited as it comes.
    following: asyncio.Future | None = asyncio.ensure_future(items.__anext__())
    try:
        await guarded(_first_of(following, started), role)
        while True:
            if following is not None and started is not None and started.done() and not started.cancelled():
                async with aclosing(on_channel(started.result(), _rest(following, items))) as outputs:
                    async for output in outputs:
                        finished = output.finished
                        yield output
                return
            item = await (following if following is not None else items.__anext__())
            following = None
            if isinstance(item, ChannelOffer):
                offered(item.replica)
            elif isinstance(item, MovedToChannel):
                async with aclosing(on_channel(item.replica, items)) as outputs:
                    async for output in outputs:
                        finished = output.finished
                        yield output
                return
            else:
                started = None  # an output on this stream: the request cannot start on the channel
                finished = item.finished
                yield item
            if started is not None:
                following = asyncio.ensure_future(items.__anext__())
                await _first_of(following, started)
    except StopAsyncIteration:
        return
    finally:
        if following is not None and not following.done():
            following.cancel()
        if not finished:
            response.cancel()


async def _first_of(following: asyncio.Future, started: asyncio.Future | None) -> None:
    """Until the stream's next item is there, or the request has started on its channel."""
    await asyncio.wait({following} if started is None else {following, started}, return_when=asyncio.FIRST_COMPLETED)


async def _rest(following: asyncio.Future, items: Any) -> AsyncIterator[Any]:
    """The stream's items from the one `following` awaits."""
    try:
        yield await following
    except StopAsyncIteration:
        return
    async for item in items:
        yield item


async def guarded(first_answer: Awaitable[T], role: str) -> T:
    """`first_answer`, unless `role` has no live replica before it comes: then the call is
    cancelled and NoHealthyWorkersError raised (Serve would hold it until a replica is back).

    A role that scales to zero (LIVE_REPLICAS.cold_start_s) is not down at zero: the call
    queued in the handle is the demand that makes Serve start a replica, so it is kept for up
    to the role's cold-start timeout, and refused only if the role still has none by then."""
    wait_s = LIVE_REPLICAS.cold_start_s(role)
    if wait_s is None and LIVE_REPLICAS.has_none(role):
        _close(first_answer)
        raise no_replicas(role)
    task = asyncio.ensure_future(first_answer)
    deadline = time.monotonic() + (wait_s or 0.0)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=LIVENESS_POLL_S)
            if done:
                return task.result()
            if LIVE_REPLICAS.has_none(role) and (wait_s is None or time.monotonic() >= deadline):
                raise no_replicas(role, wait_s)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def no_replicas(role: str, waited_s: float | None = None) -> NoHealthyWorkersError:
    if waited_s is not None:
        message = f"no {role} replica started within the {waited_s:g} s cold-start timeout (scaled to zero)"
        return NoHealthyWorkersError(message, retry_after_s=RETRY_AFTER_S)
    return NoHealthyWorkersError(f"no {role} replica is running right now", retry_after_s=RETRY_AFTER_S)


def _close(awaitable: Awaitable) -> None:
    """Withdraws a call not awaited: a Serve response is cancelled (left queued in the handle,
    it would run when a replica comes back, and count as demand until then); a coroutine
    never awaited warns unless closed."""
    for name in ("cancel", "close"):
        method = getattr(awaitable, name, None)
        if method is not None:
            method()
            return


async def answers(handle: Any) -> bool:
    try:
        await handle.stats.remote()
    except Exception:  # no replica answered
        return False
    return True
