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
    outputs = [o async for o in hub.follow(queue, call)]
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
    async for output in hub.follow(queue, call):
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
        async for output in hub.follow(queue, call):
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
    outputs = [o async for o in hub.follow(queue, call)]
    await feeder
    assert [o.token_ids for o in outputs] == [[7]]
