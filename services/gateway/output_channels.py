"""The gateway's side of output channels (the protocol: workers/output_channels.py): one
stream per engine replica that brings every step's outputs of this gateway's requests there,
handed out to each request's queue.

A request registers its queue before its call goes out (`Channels.register`), so no output
that comes on the channel before the call's own `MovedToChannel` marker is dropped; one the
replica announces on the channel (`StartsOnChannel`: none of its outputs on its call's own
stream) is followed from then on, without waiting for that marker's hop. A
replica that offers the channel gets it opened, once (`offered`); the channel's end (the
replica closed it when idle, or it failed) removes it, and the replica's next offer opens it
again. A channel that cannot be opened within OPEN_TIMEOUT_S (the replica is gone) is
not tried again for RETRY_S: its requests stream on their own calls meanwhile.

The call's own stream stays the request's lifeline while its outputs come on the channel:
its end or error is put in the same queue (`follow`), so a replica that dies fails the
request exactly as without channels, and leaving cancels the call. The call's error can come
before the last outputs the dead replica sent are read off its channel: the request then
waits for that channel's end (at most LOST_CHANNEL_END_S, then the channel is cancelled),
takes those outputs, and only then fails; a migration resumes the request under the same id,
and no output of the lost replica may reach it there. A request whose reader
fell behind gets the outputs waiting in its queue as one delta (as the worker merges its
own backlog), so the hop after the gateway carries fewer messages too.

A replica on this gateway's Ray node offers a Unix socket for the batches
(services/local_channel.py). If connecting to it fails, that replica's channel is opened as
a Ray stream from then on.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from ..engine.api.outputs import RequestOutput, merge_deltas
from ..local_channel import LocalSocket, frame, ray_node_id, read_frame
from ..serving_errors import is_worker_lost
from ..worker_calls import OpenChannel, StartsOnChannel

logger = logging.getLogger(__name__)

OPEN_TIMEOUT_S = 10.0
RETRY_S = 30.0
LOST_CHANNEL_END_S = 2.0  # a dead replica's socket ends at once; an unreachable one's is cut after this


@dataclass(slots=True)
class _CallEnded:
    """The call's own stream ended (error: how)."""

    error: BaseException | None


class Channels:
    """One per gateway process: its channel id, the open channels by replica, and the queues of
    the requests in flight."""

    def __init__(self, node: str | None = None) -> None:
        self.channel_id = f"gw-{uuid.uuid4().hex}"
        self.node = ray_node_id() if node is None else node  # "": no replica is local
        self._queues: dict[str, asyncio.Queue] = {}
        self._starts: dict[str, asyncio.Future] = {}  # request id -> set when it starts on a channel
        self._opening: dict[str, asyncio.Task] = {}  # replica address -> its channel's reader
        self._failed_at: dict[str, float] = {}  # replica address -> when opening it failed
        self._no_socket: set[str] = set()  # replicas whose socket could not be connected to

    def register(self, request_id: str) -> tuple[asyncio.Queue, asyncio.Future]:
        """The request's queue, and a future set to the replica that announces it on its
        channel (StartsOnChannel: all its outputs come there, none on its call's own stream)."""
        queue = self._queues[request_id] = asyncio.Queue()
        started = self._starts[request_id] = asyncio.get_running_loop().create_future()
        return queue, started

    def unregister(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        started = self._starts.pop(request_id, None)
        if started is not None:
            started.cancel()

    def offered(self, replica: str, handle: Any) -> None:
        """Opens the channel to `replica` (a Serve replica id of `handle`'s deployment) unless
        it is open, opening, or failed to open a moment ago."""
        if replica in self._opening:
            return
        failed_at = self._failed_at.get(replica)
        if failed_at is not None and time.monotonic() - failed_at < RETRY_S:
            return
        self._opening[replica] = asyncio.get_running_loop().create_task(self._read(replica, handle))

    async def follow(self, queue: asyncio.Queue, call_stream: Any, replica: str) -> AsyncIterator[RequestOutput]:
        """The request's outputs from `replica`'s channel, until the finished one; the call's
        own stream (`call_stream`, an iterator past its MovedToChannel marker) ending in error
        raises it, after the outputs sent before it (if the replica was lost: once its
        channel has ended)."""
        lifeline = asyncio.ensure_future(_drain(call_stream))
        lifeline.add_done_callback(lambda task: queue.put_nowait(_CallEnded(_error_of(task))))
        finished = False
        held: BaseException | None = None  # the call's error, raised after the outputs before it
        try:
            while not finished:
                if held is not None:
                    if is_worker_lost(held):
                        await self._end_channel(replica)
                        rest = _taken(queue)  # outputs only: the call ended once
                        if rest:
                            output = merge_deltas(rest)
                            finished = output.finished
                            yield output
                            if finished:
                                return
                    raise held
                item = await queue.get()
                if isinstance(item, _CallEnded):
                    held = item.error
                    continue  # ended cleanly: its outputs are on the channel, on their way
                backlog = [item]
                while not queue.empty():  # a reader behind the engine takes its backlog as one
                    more = queue.get_nowait()
                    if isinstance(more, _CallEnded):
                        held = more.error
                        break
                    backlog.append(more)
                output = merge_deltas(backlog)
                finished = output.finished
                yield output
        finally:
            if not finished:  # a finished call's stream ends by itself; cancelling costs a round trip
                lifeline.cancel()

    async def _end_channel(self, replica: str) -> None:
        """Until `replica`'s channel has ended (all it sent is in its requests' queues); cut
        after LOST_CHANNEL_END_S: `replica` is lost, and its channel with it."""
        reader = self._opening.get(replica)
        if reader is None:
            return
        done, _ = await asyncio.wait({reader}, timeout=LOST_CHANNEL_END_S)
        if not done:
            logger.warning(
                "output channel to lost replica %s did not end within %g s: cut", replica, LOST_CHANNEL_END_S
            )
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    async def close(self) -> None:
        tasks = list(self._opening.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _read(self, replica: str, handle: Any) -> None:
        node = "" if replica in self._no_socket else self.node
        response = handle.options(stream=True).open_channel.remote(OpenChannel(self.channel_id, replica, node))
        try:
            batches, writer = await self._opened(replica, response)
        except (Exception, asyncio.CancelledError) as error:
            response.cancel()
            self._opening.pop(replica, None)
            if not isinstance(error, asyncio.CancelledError):
                self._failed_at[replica] = time.monotonic()
                logger.warning("output channel to %s not opened (%s): its requests stream on their own", replica, error)
            return
        self._failed_at.pop(replica, None)
        queues, starts = self._queues, self._starts
        try:
            async for batch in batches:
                for output in batch:
                    if isinstance(output, StartsOnChannel):
                        started = starts.get(output.request_id)
                        if started is not None and not started.done():
                            started.set_result(replica)
                        continue
                    queue = queues.get(output.request_id)
                    if queue is not None:  # None: the request left; its call was cancelled
                        queue.put_nowait(output)
        except asyncio.CancelledError:
            response.cancel()
            raise
        except Exception as error:  # the replica went: its requests fail through their own calls
            logger.info("output channel to %s ended: %s", replica, error)
        finally:
            self._opening.pop(replica, None)
            if writer is not None:  # the call only kept the channel open: its end is the socket's
                writer.close()
                response.cancel()

    async def _opened(
        self, replica: str, response: Any
    ) -> tuple[AsyncIterator[list[RequestOutput]], asyncio.StreamWriter | None]:
        """The channel's batches once open: the call's own stream, or the socket the replica
        offered on it (and the socket's writer, to close it)."""
        batches = response.__aiter__()
        first = await asyncio.wait_for(batches.__anext__(), OPEN_TIMEOUT_S)  # [] once open
        if not isinstance(first, LocalSocket):
            return batches, None
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(first.path), OPEN_TIMEOUT_S)
        except Exception:
            self._no_socket.add(replica)  # its next offer opens a Ray stream instead
            raise
        writer.write(frame(self.channel_id.encode()))
        return _socket_batches(reader), writer


async def _socket_batches(reader: asyncio.StreamReader) -> AsyncIterator[list[RequestOutput]]:
    while (payload := await read_frame(reader)) is not None:
        yield pickle.loads(payload)


def _taken(queue: asyncio.Queue) -> list[Any]:
    """Everything in `queue` now, without waiting."""
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


async def _drain(call_stream: Any) -> None:
    async for _ in call_stream:
        pass


def _error_of(task: asyncio.Future) -> BaseException | None:
    if task.cancelled():
        return None
    return task.exception()
