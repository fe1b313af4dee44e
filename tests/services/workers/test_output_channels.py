"""Output channels on the engine worker without Ray (workers/output_channels.py): the calls'
own streams hand over to one channel per gateway, and the channel carries every request's
outputs, several per message, exactly as the calls alone would have; on the gateway's own
node, over a Unix socket (services/local_channel.py)."""

from __future__ import annotations

import asyncio
import os
import pickle
import stat
from contextlib import aclosing

import pytest
from baton.services.engine import SamplingParams
from baton.services.engine.api.sampling_params import RequestOutputKind
from baton.services.engine.config import EngineConfig
from baton.services.local_channel import LocalSocket, frame, read_frame
from baton.services.worker_calls import ChannelOffer, GenerateCall, MovedToChannel, OpenChannel, StartsOnChannel
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
    return [t for o in outputs if not isinstance(o, StartsOnChannel) for t in o.token_ids]


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
        assert received[rid][0] == StartsOnChannel(rid)  # announced with its first output
        assert tokens(received[rid][1:]) == expected[rid]
        assert received[rid][-1].finished and not any(o.finished for o in received[rid][1:-1])
    messages, outputs, on_socket = await worker.channel_counts()
    assert outputs == sum(len(v) for v in received.values())
    assert messages < outputs  # the requests of one step share a message
    assert on_socket == 0  # no node given: a Ray stream
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
    assert not any(isinstance(o, StartsOnChannel) for o in rest)  # it began on its own stream
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


# -- on the gateway's node: a Unix socket ----------------------------------------------------

NODE = "node-a"


async def open_local(worker: EngineWorker):
    """Opens CHANNEL as a gateway on the replica's node does: (the call's stream, reader, writer)."""
    worker.channels.node = NODE
    batches = worker.open_channel(OpenChannel(CHANNEL, worker.info.address, NODE))
    offer = await anext(batches)
    assert isinstance(offer, LocalSocket)
    assert stat.S_IMODE(os.stat(os.path.dirname(offer.path)).st_mode) == 0o700  # this user's only
    reader, writer = await asyncio.open_unix_connection(offer.path)
    writer.write(frame(CHANNEL.encode()))
    lifetime = asyncio.ensure_future(collect(batches))  # Serve drives the call; it yields nothing more
    while CHANNEL in worker.channels._listener._expected:  # until the replica has taken the connection
        await asyncio.sleep(0.01)
    return lifetime, reader, writer


async def read_socket(reader, received: dict[str, list]) -> None:
    while not all(v and v[-1].finished for v in received.values()):
        for output in pickle.loads(await read_frame(reader)):
            received[output.request_id].append(output)


async def test_on_the_gateways_node_the_batches_come_on_a_socket_and_equal_the_calls(workers):
    worker = workers("colocated")
    expected = {f"s{i}": tokens([o async for o in worker.generate(call(f"s{i}", channel=None))]) for i in range(4)}
    lifetime, reader, writer = await open_local(worker)
    received: dict[str, list] = {rid: [] for rid in expected}
    streams = await asyncio.gather(*(collect_stream(worker, rid) for rid in expected), read_socket(reader, received))
    for rid, (markers, on_stream) in zip(expected, streams[:-1], strict=True):
        assert markers == [MovedToChannel(worker.info.address)] and on_stream == []
        assert received[rid][0] == StartsOnChannel(rid)
        assert tokens(received[rid]) == expected[rid]
    messages, _, on_socket = await worker.channel_counts()
    assert on_socket == messages > 0
    assert not lifetime.done()  # the call stays open for as long as the channel
    writer.close()
    assert await asyncio.wait_for(lifetime, 10) == []  # the gateway closed the socket: the channel ends
    assert not worker.channels.is_open(CHANNEL)


async def test_a_gateway_on_another_node_gets_a_ray_stream(workers):
    worker = workers("colocated")
    worker.channels.node = NODE
    async with aclosing(worker.open_channel(OpenChannel(CHANNEL, worker.info.address, "node-b"))) as batches:
        assert await anext(batches) == []


async def test_a_gateway_that_leaves_its_socket_fails_the_requests_on_it(workers):
    worker = workers("colocated")
    lifetime, reader, writer = await open_local(worker)
    stream = worker.generate(call("orphan", max_tokens=500))
    assert await anext(stream) == MovedToChannel(worker.info.address)
    await read_frame(reader)  # its first output came
    writer.close()
    with pytest.raises(ChannelClosedError, match="closed under request orphan"):
        await collect(stream)
    await asyncio.wait_for(lifetime, 10)
    await wait_for(worker, lambda s: s.num_running == 0 and s.num_free_kv_blocks == s.num_kv_blocks)


async def test_an_idle_socket_channel_ends_its_socket_and_its_call(workers, monkeypatch):
    monkeypatch.setattr(output_channels, "IDLE_CLOSE_S", 0.2)
    worker = workers("colocated")
    lifetime, reader, _ = await open_local(worker)
    assert await asyncio.wait_for(read_frame(reader), 10) is None  # end of stream, between frames
    assert await asyncio.wait_for(lifetime, 10) == []


async def test_a_gateway_that_never_connects_ends_the_channel(workers, monkeypatch):
    monkeypatch.setattr(output_channels, "CONNECT_TIMEOUT_S", 0.2)
    worker = workers("colocated")
    worker.channels.node = NODE
    batches = worker.open_channel(OpenChannel(CHANNEL, worker.info.address, NODE))
    assert isinstance(await anext(batches), LocalSocket)
    with pytest.raises(ChannelClosedError, match="did not connect"):
        await anext(batches)
    assert not worker.channels.is_open(CHANNEL)


async def test_a_connection_naming_no_open_channel_is_closed(workers):
    worker = workers("colocated")
    lifetime, _, writer = await open_local(worker)
    path = worker.channels._listener.path
    reader, stranger = await asyncio.open_unix_connection(path)
    stranger.write(frame(b"gw-not-opening"))
    assert await asyncio.wait_for(reader.read(), 10) == b""  # closed on it
    writer.close()
    await asyncio.wait_for(lifetime, 10)


async def test_shutdown_removes_the_socket(workers):
    worker = workers("colocated")
    lifetime, _, writer = await open_local(worker)
    path = worker.channels._listener.path
    worker.channels.close()
    assert not os.path.exists(path) and not os.path.exists(os.path.dirname(path))
    writer.close()
    await asyncio.wait_for(lifetime, 10)
