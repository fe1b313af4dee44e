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

On the gateway's own Ray node the batches go over a Unix socket instead of the stream
(services/local_channel.py): the stream's first item is then `LocalSocket(path)`, and the
stream stays open, empty, for as long as the channel. A request whose outputs all go on the
channel is announced there (`StartsOnChannel`) with its first output, so the gateway follows
it without waiting for the MovedToChannel marker on the call's own stream.

A channel closes itself after IDLE_CLOSE_S without requests on it, so an idle replica has no
call in flight soon after its last request: scale to zero waits for that, and so does a
replica that drains (Serve looks at its in-flight calls every 2 s, and kills it at the end of
its grace period, without the destructor that deregisters it from the router). The next
request of that gateway offers the channel again. Nothing here is needed for correctness: a call without a channel
(`GenerateCall.channel` None) streams as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
from collections.abc import AsyncIterator
from contextlib import aclosing

from ..engine.api.outputs import RequestOutput
from ..local_channel import LocalSocket, SocketListener, frame
from ..worker_calls import ChannelOffer, GenerateCall, MovedToChannel, StartsOnChannel

logger = logging.getLogger(__name__)

IDLE_CLOSE_S = 0.5  # a channel with no request on it for this long ends its stream
CONNECT_TIMEOUT_S = 10.0  # for the gateway to connect to the socket offered


class ChannelClosedError(RuntimeError):
    """The gateway's channel ended while a request's outputs were going to it."""


class _Channel:
    def __init__(self) -> None:
        self.pending: list[RequestOutput | StartsOnChannel] = []
        self.num_requests = 0  # moved onto it, not finished
        self.closed = False
        self.peer_left = False  # the gateway closed the channel's socket
        self._wakeup = asyncio.Event()

    def push(self, item: RequestOutput | StartsOnChannel) -> None:
        self.pending.append(item)
        self._wakeup.set()

    async def watch(self, reader: asyncio.StreamReader) -> None:
        """Ends the channel when the gateway's side of its socket closes (it sends nothing more)."""
        with contextlib.suppress(Exception):
            while await reader.read(1 << 16):
                pass
        self.peer_left = True
        self._wakeup.set()

    async def next_batch(self) -> list[RequestOutput | StartsOnChannel] | None:
        """What was pushed since the last batch; None once idle for IDLE_CLOSE_S, or once the
        gateway left."""
        while not self.pending:
            if self.peer_left:
                return None
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), IDLE_CLOSE_S)
            except TimeoutError:
                if self.num_requests == 0 and not self.pending:
                    return None
        # One more turn of the loop: the other requests of this step push behind the first.
        await asyncio.sleep(0)
        if self.peer_left:
            return None
        batch, self.pending = self.pending, []
        return batch


class OutputChannels:
    """The channels open on this replica, by channel id (one per gateway replica)."""

    def __init__(self, replica_address: str, node: str = "") -> None:
        self.replica_address = replica_address
        self.node = node  # this replica's Ray node ("": none, so no channel is local)
        self._open: dict[str, _Channel] = {}
        self._listener = SocketListener()
        self._socket_failed = False  # logged once
        self.num_messages = 0  # batches sent on channels (each one Ray object, or one frame)
        self.num_outputs = 0  # request outputs (and StartsOnChannel markers) they carried
        self.num_socket_messages = 0  # of num_messages, those sent on a local socket

    def is_open(self, channel_id: str) -> bool:
        return channel_id in self._open

    async def serve(self, channel_id: str, node: str = "") -> AsyncIterator[list[RequestOutput] | LocalSocket]:
        """The body of `open_channel` for a gateway on Ray node `node`: an empty batch once
        open, then every step's outputs; or, on this replica's node, a LocalSocket, and the
        outputs on it."""
        older = self._open.pop(channel_id, None)
        if older is not None:  # the gateway reopened it: the old stream is gone on its side
            older.closed = True
        channel = self._open[channel_id] = _Channel()
        connected: asyncio.Future | None = None
        writer: asyncio.StreamWriter | None = None
        watcher: asyncio.Task | None = None
        try:
            path = await self._socket_path() if node and node == self.node else None
            if path is not None:
                connected = self._listener.expect(channel_id)
                yield LocalSocket(path)
                await asyncio.wait({connected}, timeout=CONNECT_TIMEOUT_S)
                if not connected.done() or connected.cancelled():  # cancelled: reopened meanwhile
                    raise ChannelClosedError(
                        f"the gateway of output channel {channel_id} did not connect to its socket"
                    )
                reader, writer = connected.result()
                watcher = asyncio.ensure_future(channel.watch(reader))
            else:
                yield []
            while (batch := await channel.next_batch()) is not None:
                self.num_messages += 1
                self.num_outputs += len(batch)
                if writer is None:
                    yield batch
                    continue
                self.num_socket_messages += 1
                writer.write(frame(pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)))
                await writer.drain()
        finally:
            channel.closed = True
            if connected is not None:
                self._listener.forget(channel_id, connected)
            if watcher is not None:
                watcher.cancel()
            if writer is not None:
                writer.close()
            if self._open.get(channel_id) is channel:
                del self._open[channel_id]

    async def deliver(
        self, call: GenerateCall, outputs: AsyncIterator[RequestOutput]
    ) -> AsyncIterator[RequestOutput | ChannelOffer | MovedToChannel]:
        """A call's stream: its outputs, until its channel is open here; then the marker, and
        every later output goes onto the channel while the stream stays open until the end.
        Closing this closes `outputs` (which aborts the request)."""
        channel: _Channel | None = None
        streamed = False  # an output went on the call's own stream
        try:
            async with aclosing(outputs):
                if call.channel is not None and not self.is_open(call.channel):
                    yield ChannelOffer(self.replica_address)
                async for output in outputs:
                    moved = False
                    if channel is None and call.channel is not None:
                        channel = self._open.get(call.channel)
                        if channel is not None:
                            channel.num_requests += 1
                            moved = True
                            if not streamed:
                                channel.push(StartsOnChannel(call.request_id))
                    if channel is None:
                        streamed = True
                        yield output
                        continue
                    if channel.closed:
                        raise ChannelClosedError(
                            f"output channel {call.channel} closed under request {call.request_id}"
                        )
                    channel.push(output)
                    if moved:  # after the output, which need not wait for it when it starts there
                        yield MovedToChannel(self.replica_address)
        finally:
            if channel is not None:
                channel.num_requests -= 1

    def close(self) -> None:
        """Stops listening for local sockets (from any thread)."""
        self._listener.close()

    async def _socket_path(self) -> str | None:
        """The local socket's path; None (the channel takes the Ray stream) if it cannot listen."""
        try:
            return await self._listener.start()
        except OSError as error:
            if not self._socket_failed:
                logger.warning("output channels cannot listen on a Unix socket (%s): they take Ray streams", error)
            self._socket_failed = True
            return None
