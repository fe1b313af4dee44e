"""The gateway's side of output channels without Ray (gateway/output_channels.py): a request
follows its queue to the finished output, takes a backlog as one delta, and its call's
error reaches it after the outputs that came before it."""

from __future__ import annotations

import asyncio

import pytest
from baton.services.engine.api.outputs import CompletionOutput, RequestOutput
from baton.services.gateway.output_channels import Channels


def delta(tokens: list[int], finished: bool = False) -> RequestOutput:
    completion = CompletionOutput(
        0, "".join(f"<{t}>" for t in tokens), tokens, None, None, "length" if finished else None
    )
    return RequestOutput("r", None, [1, 2], [completion], finished, 0)


class CallStream:
    """A call's own stream past its MovedToChannel marker: empty, ending when told (or failing)."""

    def __init__(self) -> None:
        self.end = asyncio.get_running_loop().create_future()

    def __aiter__(self):
        return self

    async def __anext__(self):
        await self.end
        raise StopAsyncIteration


async def test_a_backlog_comes_as_one_delta_and_the_stream_stops_at_the_finished_output():
    hub = Channels()
    queue, _ = hub.register("r")
    for output in (delta([1]), delta([2, 3]), delta([4], finished=True)):
        queue.put_nowait(output)
    call = CallStream()
    outputs = [o async for o in hub.follow(queue, call, "R")]
    assert len(outputs) == 1 and outputs[0].finished
    assert outputs[0].token_ids == [1, 2, 3, 4] and outputs[0].text == "<1><2><3><4>"


async def test_outputs_that_arrive_one_by_one_are_streamed_one_by_one():
    hub = Channels()
    queue, _ = hub.register("r")
    call = CallStream()
    seen = []

    async def feed() -> None:
        for tokens, finished in (([1], False), ([2], False), ([3], True)):
            queue.put_nowait(delta(tokens, finished))
            await asyncio.sleep(0.01)

    feeder = asyncio.ensure_future(feed())
    async for output in hub.follow(queue, call, "R"):
        seen.append(output.token_ids)
    await feeder
    assert seen == [[1], [2], [3]]


async def test_the_calls_error_is_raised_after_the_outputs_before_it():
    hub = Channels()
    queue, _ = hub.register("r")
    call = CallStream()
    queue.put_nowait(delta([1]))
    call.end.set_exception(RuntimeError("replica died"))
    seen = []
    with pytest.raises(RuntimeError, match="replica died"):
        async for output in hub.follow(queue, call, "R"):
            seen.append(output.token_ids)
    assert seen == [[1]]


async def test_a_clean_end_of_the_call_waits_for_the_outputs_still_on_their_way():
    hub = Channels()
    queue, _ = hub.register("r")
    call = CallStream()
    call.end.set_result(None)  # the worker's generator returned; the channel is behind
    await asyncio.sleep(0)

    async def late() -> None:
        await asyncio.sleep(0.05)
        queue.put_nowait(delta([7], finished=True))

    feeder = asyncio.ensure_future(late())
    outputs = [o async for o in hub.follow(queue, call, "R")]
    await feeder
    assert [o.token_ids for o in outputs] == [[7]]


class ChannelStream:
    """A replica's channel as its open_channel call streams it (no local socket): [] once
    open, then the batches put in `batches`; None there ends it. `stuck`: it never ends."""

    def __init__(self) -> None:
        self.batches: asyncio.Queue = asyncio.Queue()
        self.batches.put_nowait([])
        self.cancelled = False

    def options(self, stream: bool):
        return self

    @property
    def open_channel(self):
        return self

    def remote(self, argument):
        return self

    def __aiter__(self):
        return self

    async def __anext__(self):
        batch = await self.batches.get()
        if batch is None:
            raise StopAsyncIteration
        return batch

    def cancel(self) -> None:
        self.cancelled = True


async def follow_until_lost(hub: Channels, channel: ChannelStream) -> tuple[list[list[int]], BaseException]:
    """Request "r" on replica R's channel: [1] comes, then its call fails as a dead replica's
    does, while [2] still waits in the channel (as frames wait in a dead process's socket)."""
    from ray.exceptions import ActorDiedError

    hub.offered("R", channel)
    queue, _ = hub.register("r")
    call = CallStream()
    channel.batches.put_nowait([delta([1])])
    seen = []
    stream = hub.follow(queue, call, "R")
    seen.append((await anext(stream)).token_ids)
    call.end.set_exception(ActorDiedError())
    await asyncio.sleep(0.01)  # the call's error is in the queue; the channel's [2] is not read yet
    channel.batches.put_nowait([delta([2])])
    try:
        async for output in stream:
            seen.append(output.token_ids)
    except ActorDiedError as error:
        return seen, error
    raise AssertionError("the call's error was not raised")


async def test_a_lost_replicas_last_outputs_come_before_its_error_and_never_reach_the_migrated_request():
    hub = Channels(node="")
    channel = ChannelStream()

    async def end_later() -> None:  # the dead process's stream ends after the call's error came
        await asyncio.sleep(0.05)
        channel.batches.put_nowait(None)

    ender = asyncio.ensure_future(end_later())
    seen, _ = await follow_until_lost(hub, channel)
    await ender
    assert seen == [[1], [2]]  # what the replica sent before it died, then the error
    hub.unregister("r")
    resumed, _ = hub.register("r")  # the migration resumes it under the same id, elsewhere
    await asyncio.sleep(0.05)
    assert resumed.empty()


async def test_a_lost_replicas_channel_that_does_not_end_is_cut(monkeypatch):
    from baton.services.gateway import output_channels

    monkeypatch.setattr(output_channels, "LOST_CHANNEL_END_S", 0.05)
    hub = Channels(node="")
    channel = ChannelStream()  # unreachable: its stream neither ends nor fails
    seen, _ = await follow_until_lost(hub, channel)
    assert seen == [[1], [2]]
    assert channel.cancelled and "R" not in hub._opening
    hub.unregister("r")
    resumed, _ = hub.register("r")
    channel.batches.put_nowait([delta([3])])
    await asyncio.sleep(0.05)
    assert resumed.empty()
