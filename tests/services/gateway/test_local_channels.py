"""The gateway's side of a channel on its own node (gateway/output_channels.py over
services/local_channel.py), against a real engine worker without Ray: a stand-in handle runs
the worker's streaming methods as Serve would (each call a task its `cancel` cancels). A
request that starts on the channel follows it without waiting for its MovedToChannel marker;
a socket that cannot be connected to sends that replica's channel over the Ray stream."""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing

import pytest
from baton.services.engine import SamplingParams
from baton.services.engine.api.sampling_params import RequestOutputKind
from baton.services.engine.config import EngineConfig
from baton.services.gateway import engine_client
from baton.services.gateway.output_channels import Channels
from baton.services.local_channel import LocalSocket
from baton.services.worker_calls import GenerateCall, MovedToChannel
from baton.services.workers.engine_worker import EngineWorker
from testlib.worker_stats import wait_for_stats as wait_for

NODE = "node-a"
PROMPT = list(range(200, 240))
MARKER_DELAY_S = 30.0


class Response:
    """A Serve streaming response: the method's items, driven by a task of their own (as the
    replica drives its generator whatever the transport does); with `delay_markers`, the
    stream's items from a MovedToChannel on reach the reader MARKER_DELAY_S late."""

    def __init__(self, items, delay_markers: bool) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._held_until = 0.0
        self._delay_markers = delay_markers
        self._task = asyncio.ensure_future(self._drive(items))

    def _put(self, item, error) -> None:
        if self._delay_markers and isinstance(item, MovedToChannel):
            self._held_until = time.monotonic() + MARKER_DELAY_S
        self._queue.put_nowait((max(time.monotonic(), self._held_until), item, error))

    async def _drive(self, items) -> None:
        try:
            async with aclosing(items):
                async for item in items:
                    self._put(item, None)
        except Exception as error:  # noqa: BLE001 - handed to the reader
            self._put(None, error)
            return
        self._put(None, StopAsyncIteration())

    def __aiter__(self):
        return self

    async def __anext__(self):
        release_at, item, error = await self._queue.get()
        await asyncio.sleep(max(0.0, release_at - time.monotonic()))
        if error is not None:
            raise error
        return item

    def cancel(self) -> None:
        self._task.cancel()


class Handle:
    """`handle.options(stream=True).<method>.remote(argument)` on an EngineWorker."""

    def __init__(self, worker: EngineWorker, delay_markers: bool = False, rewrite=None) -> None:
        self.worker, self.delay_markers, self.rewrite = worker, delay_markers, rewrite
        self.responses: list[Response] = []

    def options(self, stream: bool):
        assert stream
        return self

    def __getattr__(self, method: str):
        handle = self

        class Method:
            def remote(self, argument):
                items = getattr(handle.worker, method)(argument)
                if handle.rewrite is not None:
                    items = handle.rewrite(items)
                response = Response(items, handle.delay_markers)
                handle.responses.append(response)
                return response

        return Method()

    def close(self) -> None:
        for response in self.responses:
            response.cancel()


@pytest.fixture
def worker(llama_dir):
    config = EngineConfig.from_kwargs(model=str(llama_dir), num_kv_blocks=64, block_size=16)
    worker = EngineWorker("colocated", config, "tiny", replica_id="colocated-test")
    worker.channels.node = NODE
    yield worker
    worker.shutdown()


@pytest.fixture
def hub(monkeypatch):
    hub = Channels(node=NODE)
    monkeypatch.setattr(engine_client, "_CHANNELS", hub)
    return hub


def call(request_id: str, max_tokens: int = 16) -> GenerateCall:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    return GenerateCall(request_id, PROMPT[: 10 + len(request_id)], params)


async def generated(handle: Handle, request_id: str, max_tokens: int = 16) -> list[int]:
    sent = call(request_id, max_tokens)
    outputs = engine_client.streamed(handle, "generate", sent, sent, "c", True)
    async with aclosing(outputs) as stream:
        return [t async for output in stream for t in output.token_ids]


async def alone(worker: EngineWorker, request_id: str, max_tokens: int = 16) -> list[int]:
    return [t async for o in worker.generate(call(request_id, max_tokens)) for t in o.token_ids]


async def test_requests_on_a_local_channel_equal_their_own_streams_and_skip_the_marker(worker, hub):
    expected = {rid: await alone(worker, rid) for rid in ("a", "bb", "ccc")}
    handle = Handle(worker, delay_markers=True)
    try:
        assert await generated(handle, "warm") == await alone(worker, "warm")  # offers and opens the channel
        await asyncio.sleep(0.1)
        started = time.monotonic()
        streams = await asyncio.wait_for(asyncio.gather(*(generated(handle, rid) for rid in expected)), 20)
        assert time.monotonic() - started < MARKER_DELAY_S / 2  # none waited for its marker
    finally:
        handle.close()
    assert dict(zip(expected, streams, strict=True)) == expected
    messages, _, on_socket = await worker.channel_counts()
    assert on_socket > 0  # the batches came on the socket
    await wait_for(worker, lambda s: s.num_running == 0 and s.num_free_kv_blocks == s.num_kv_blocks)


async def test_leaving_a_request_on_a_local_channel_ends_it_on_the_engine(worker, hub):
    handle = Handle(worker)
    try:
        await generated(handle, "warm")
        await asyncio.sleep(0.1)
        sent = call("left", 900)
        outputs = engine_client.streamed(handle, "generate", sent, sent, "c", True)
        async with aclosing(outputs) as stream:
            for _ in range(3):
                await anext(stream)
        await wait_for(worker, lambda s: s.num_running == 0 and s.num_free_kv_blocks == s.num_kv_blocks)
    finally:
        handle.close()


async def test_a_socket_that_cannot_be_reached_sends_the_channel_over_the_stream(worker, hub):
    async def unreachable(items):
        async for item in items:
            yield LocalSocket("/nonexistent/baton.sock") if isinstance(item, LocalSocket) else item

    handle = Handle(worker, rewrite=unreachable)
    try:
        assert await generated(handle, "first") == await alone(worker, "first")  # on its own stream
        await asyncio.sleep(0.1)
        hub._failed_at.clear()  # without waiting RETRY_S for the next try
        assert await generated(handle, "second") == await alone(worker, "second")
        await asyncio.sleep(0.1)
        assert await generated(handle, "third") == await alone(worker, "third")
    finally:
        handle.close()
    messages, outputs, on_socket = await worker.channel_counts()
    assert on_socket == 0 and outputs > 0  # the channel opened, as a Ray stream
