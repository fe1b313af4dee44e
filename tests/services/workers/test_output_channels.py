"""Output channels on the engine worker without Ray (workers/output_channels.py): the calls'
own streams hand over to one channel per gateway, and the channel carries every request's
outputs, several per message, exactly as the calls alone would have."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest
from baton.services.engine import SamplingParams
from baton.services.engine.api.sampling_params import RequestOutputKind
from baton.services.engine.config import EngineConfig
from baton.services.worker_calls import ChannelOffer, GenerateCall, MovedToChannel, OpenChannel
from baton.services.workers import output_channels
from baton.services.workers.engine_worker import EngineWorker
from baton.services.workers.output_channels import ChannelClosedError
from testlib.worker_stats import wait_for_stats as wait_for

CHANNEL = "gw-test"
PROMPT = list(range(100, 150))


@pytest.fixture
def workers(llama_dir):
    made: list[EngineWorker] = []

    def make(role: str) -> EngineWorker:
        config = EngineConfig.from_kwargs(model=str(llama_dir), num_kv_blocks=64, block_size=16, role=role)
        made.append(EngineWorker(role, config, "tiny", replica_id=f"{role}-test"))
        return made[-1]

    yield make
    for worker in made:
        worker.shutdown()


def call(request_id: str, max_tokens: int = 12, channel: str | None = CHANNEL) -> GenerateCall:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    return GenerateCall(request_id, PROMPT[: 20 + len(request_id)], params, channel=channel)


def tokens(outputs) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


async def test_a_call_moves_onto_its_open_channel_and_many_share_its_messages(workers):
    worker = workers("colocated")
    expected = {}
    for i in range(6):
        expected[f"r{i}"] = tokens([o async for o in worker.generate(call(f"r{i}", channel=None))])

    async with aclosing(worker.open_channel(OpenChannel(CHANNEL, worker.info.address))) as batches:
        assert await anext(batches) == []  # open
        received: dict[str, list] = {rid: [] for rid in expected}
        streams = await asyncio.gather(*(collect_stream(worker, rid) for rid in expected), read(batches, received))
    for rid, (markers, on_stream) in zip(expected, streams[:-1], strict=True):
        assert markers == [MovedToChannel(worker.info.address)]  # open before the call: no offer
        assert on_stream == []  # nothing after the marker on the call's own stream
        assert tokens(received[rid]) == expected[rid]
        assert received[rid][-1].finished and not any(o.finished for o in received[rid][:-1])
    messages, outputs = await worker.channel_counts()
    assert outputs == sum(len(v) for v in received.values())
    assert messages < outputs  # the requests of one step share a message
    stats = await worker.check_integrity()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


async def collect(stream) -> list:
    return [item async for item in stream]


async def collect_stream(worker, request_id: str):
    markers, after = [], []
    async for item in worker.generate(call(request_id)):
        (markers if isinstance(item, ChannelOffer | MovedToChannel) else after).append(item)
    return markers, after


async def read(batches, received: dict[str, list]) -> None:
    while not all(v and v[-1].finished for v in received.values()):
        for output in await anext(batches):
            received[output.request_id].append(output)


async def test_a_call_before_its_channel_opens_offers_it_and_streams_until_then(workers):
    worker = workers("colocated")
    expected = tokens([o async for o in worker.generate(call("solo", max_tokens=30, channel=None))])
    stream = worker.generate(call("solo", max_tokens=30))
    assert await anext(stream) == ChannelOffer(worker.info.address)
    first = await anext(stream)  # on the call's own stream: no channel yet
    async with aclosing(worker.open_channel(OpenChannel(CHANNEL, worker.info.address))) as batches:
        assert await anext(batches) == []
        assert await anext(stream) == MovedToChannel(worker.info.address)
        driven = asyncio.ensure_future(collect(stream))  # Serve drives a call's stream to its end
        rest = []
        while not (rest and rest[-1].finished):
            rest.extend(await anext(batches))
        assert await driven == []  # the call's stream ends with the request, empty
    assert tokens([first, *rest]) == expected


async def test_leaving_a_call_on_a_channel_aborts_its_request(workers):
    worker = workers("colocated")
    async with aclosing(worker.open_channel(OpenChannel(CHANNEL, worker.info.address))) as batches:
        assert await anext(batches) == []
        stream = worker.generate(call("left", max_tokens=500))
        assert await anext(stream) == MovedToChannel(worker.info.address)
        driven = asyncio.ensure_future(collect(stream))
        await anext(batches)  # a first output came on the channel
        driven.cancel()  # as Serve does when the caller cancels
        await asyncio.gather(driven, return_exceptions=True)
        stats = await wait_for(worker, lambda s: s.num_running == 0 and s.num_free_kv_blocks == s.num_kv_blocks)
        assert stats.num_waiting == 0


async def test_a_channel_closed_under_a_request_fails_it(workers):
    worker = workers("colocated")
    batches = worker.open_channel(OpenChannel(CHANNEL, worker.info.address))
    assert await anext(batches) == []
    stream = worker.generate(call("orphan", max_tokens=500))
    assert await anext(stream) == MovedToChannel(worker.info.address)
    await batches.aclose()  # the gateway's side went
    with pytest.raises(ChannelClosedError, match="closed under request orphan"):
        await collect(stream)
    await wait_for(worker, lambda s: s.num_running == 0 and s.num_free_kv_blocks == s.num_kv_blocks)


async def test_an_idle_channel_ends_and_the_next_call_offers_it_again(workers, monkeypatch):
    monkeypatch.setattr(output_channels, "IDLE_CLOSE_S", 0.2)
    worker = workers("colocated")
    batches = worker.open_channel(OpenChannel(CHANNEL, worker.info.address))
    assert await anext(batches) == []
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(anext(batches), 10)  # no request on it: it ends
    assert not worker.channels.is_open(CHANNEL)
    items = [item async for item in worker.generate(call("later"))]
    assert items[0] == ChannelOffer(worker.info.address) and items[-1].finished


async def test_a_call_without_a_channel_streams_as_before(workers):
    worker = workers("colocated")
    items = [item async for item in worker.generate(call("plain", channel=None))]
    assert all(not isinstance(i, ChannelOffer | MovedToChannel) for i in items) and items[-1].finished
