"""The engine replica's side of output channels: one stream per gateway carrying every step's
outputs for all of that gateway's requests here, instead of one Ray object per request per step.

Serve streams each call's items as Ray objects, and each costs CPU in both processes (a
pickle, an object in the store, a report to the owner) whatever its size. At concurrency 16
that is 16 objects per engine step, on the same cores the engine steps on. A gateway opens
one channel per engine replica (`EngineWorker.open_channel`, pinned to the replica by the
request routers) and a request's outputs move onto it:

    gateway                                  engine replica
    generate(call, channel=C)  ------------> ChannelOffer(replica)   C not open here yet
                               <------------ outputs on the call's own stream
    open_channel(C)  (pinned)  ------------> [] (open)
                               <------------ MovedToChannel(replica) next output of the call
                               <====C======= [outputs of this step, every request of C]
    the call's stream stays open, empty, until the request ends: cancelling it aborts the
    request, and a dead replica fails it, as without channels.

A channel closes itself after IDLE_CLOSE_S without requests on it, so an idle replica has no
call in flight soon after its last request: scale to zero waits for that, and so does a
replica that drains (Serve looks at its in-flight calls every 2 s, and kills it at the end of
its grace period, without the destructor that deregisters it from the router). The next
request of that gateway offers the channel again. Nothing here is needed for correctness: a call without a channel
(`GenerateCall.channel` None) streams as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing

from ..engine.api.outputs import RequestOutput
from ..worker_calls import ChannelOffer, GenerateCall, MovedToChannel

IDLE_CLOSE_S = 0.5  # a channel with no request on it for this long ends its stream


class ChannelClosedError(RuntimeError):
    """The gateway's channel ended while a request's outputs were going to it."""


class _Channel:
    def __init__(self) -> None:
        self.pending: list[RequestOutput] = []
        self.num_requests = 0  # moved onto it, not finished
        self.closed = False
        self._wakeup = asyncio.Event()

    def push(self, output: RequestOutput) -> None:
        self.pending.append(output)
        self._wakeup.set()

    async def next_batch(self) -> list[RequestOutput] | None:
        """What was pushed since the last batch; None once idle for IDLE_CLOSE_S."""
        while not self.pending:
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), IDLE_CLOSE_S)
            except TimeoutError:
                if self.num_requests == 0 and not self.pending:
                    return None
        # One more turn of the loop: the other requests of this step push behind the first.
        await asyncio.sleep(0)
        batch, self.pending = self.pending, []
        return batch


class OutputChannels:
    """The channels open on this replica, by channel id (one per gateway replica)."""

    def __init__(self, replica_address: str) -> None:
        self.replica_address = replica_address
        self._open: dict[str, _Channel] = {}
        self.num_messages = 0  # batches sent on channels (each one Ray object)
        self.num_outputs = 0  # request outputs they carried

    def is_open(self, channel_id: str) -> bool:
        return channel_id in self._open

    async def serve(self, channel_id: str) -> AsyncIterator[list[RequestOutput]]:
        """The body of `open_channel`: an empty batch once open, then every step's outputs."""
        older = self._open.pop(channel_id, None)
        if older is not None:  # the gateway reopened it: the old stream is gone on its side
            older.closed = True
        channel = self._open[channel_id] = _Channel()
        try:
            yield []
            while (batch := await channel.next_batch()) is not None:
                self.num_messages += 1
                self.num_outputs += len(batch)
                yield batch
        finally:
            channel.closed = True
            if self._open.get(channel_id) is channel:
                del self._open[channel_id]

    async def deliver(
        self, call: GenerateCall, outputs: AsyncIterator[RequestOutput]
    ) -> AsyncIterator[RequestOutput | ChannelOffer | MovedToChannel]:
        """A call's stream: its outputs, until its channel is open here; then the marker, and
        every later output goes onto the channel while the stream stays open until the end.
        Closing this closes `outputs` (which aborts the request)."""
        channel: _Channel | None = None
        try:
            async with aclosing(outputs):
                if call.channel is not None and not self.is_open(call.channel):
                    yield ChannelOffer(self.replica_address)
                async for output in outputs:
                    if channel is None and call.channel is not None:
                        channel = self._open.get(call.channel)
                        if channel is not None:
                            channel.num_requests += 1
                            yield MovedToChannel(self.replica_address)
                    if channel is None:
                        yield output
                        continue
                    if channel.closed:
                        raise ChannelClosedError(
                            f"output channel {call.channel} closed under request {call.request_id}"
                        )
                    channel.push(output)
        finally:
            if channel is not None:
                channel.num_requests -= 1
