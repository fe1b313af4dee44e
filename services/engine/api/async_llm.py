"""The asynchronous engine the services wrap: streams outputs to asyncio callers.

One engine thread owns the `EngineCore` and runs its step loop; asyncio callers talk to it
through a command queue (add, abort, run-a-function) and receive outputs on per-request
asyncio queues. A step never blocks the caller's event loop, and one loop serves every
request, exactly as `LLM.generate` does offline.

    caller (event loop)                       engine thread
    generate() -> prepare() ---- add ---->    submit(); step(); step(); ...
      <------------- outputs via call_soon_threadsafe ----
    (cancelled) ---------------- abort --->   abort_request() frees the blocks
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from ..config import EngineConfig
from ..core.kv_events import KVEventPublisher
from ..engine_core import EngineCore
from ..errors import EngineDeadError, InvalidRequestError
from ..stats import EngineStats
from ..weight_updates import PauseMode, WeightUpdates
from .handover import Handover
from .outputs import RequestOutput, merge_deltas
from .sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")
_IDLE_TICK_S = 0.25
_POLL_TICK_S = 0.002
_DRAIN_TICK_S = 0.005


class RequestStream:
    """A request's outputs, in order. Closing it (or cancelling a read) before the request
    finishes aborts the request, which frees its KV blocks."""

    def __init__(self, request_id: str, engine: AsyncLLM) -> None:
        self.request_id = request_id
        self.finished = False
        self._engine = engine
        self._queue: asyncio.Queue = asyncio.Queue()
        self._held: BaseException | None = None  # an error queued behind outputs being merged
        self.loop = asyncio.get_running_loop()

    def put(self, item: RequestOutput | BaseException) -> bool:
        """Hands an item over from the engine thread; False if the reader's loop is gone."""
        try:
            self.loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop was closed
            return False
        return True

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        if self._held is not None:
            item, self._held = self._held, None
        else:
            try:
                item = await self._queue.get()
            except asyncio.CancelledError:
                await self.aclose()
                raise
        return self._take(item)

    async def merged(self, kind: RequestOutputKind) -> AsyncIterator[RequestOutput]:
        """The outputs, each merged with those already waiting behind it: a reader that falls
        behind the engine gets its backlog in one message (several tokens per delta) rather
        than paying per-message costs once per step. CUMULATIVE and FINAL_ONLY outputs
        supersede each other, so the latest stands for the backlog."""
        async for output in self:
            backlog = [output]
            while not self.finished and not self._queue.empty():
                item = self._queue.get_nowait()
                if isinstance(item, BaseException):
                    self._held = item  # raised after the outputs that came before it
                    break
                backlog.append(self._take(item))
            yield merge_deltas(backlog) if kind is RequestOutputKind.DELTA else backlog[-1]

    def _take(self, item: RequestOutput | BaseException) -> RequestOutput:
        if isinstance(item, BaseException):
            self.finished = True
            self._engine._forget(self.request_id)
            raise item
        if item.finished:
            self.finished = True
            self._engine._forget(self.request_id)
        return item

    async def aclose(self) -> None:
        if not self.finished:
            self.finished = True
            self._engine._forget(self.request_id)
            self._engine.abort(self.request_id)


class AsyncLLM:
    def __init__(
        self,
        config: EngineConfig,
        kv_event_publisher: KVEventPublisher | None = None,
        core: EngineCore | None = None,
        worker_id: str = "",
    ) -> None:
        self._commands: deque[Callable[[], None]] = deque()
        self._wakeup = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._streams_lock = threading.Lock()
        self._dead: BaseException | None = None
        self._stopping = False
        # The engine thread builds the core itself: the thread that loads the model is the
        # one whose OpenMP team runs it (model/cpu_tuning.py says why that matters).
        built: concurrent.futures.Future[None] = concurrent.futures.Future()
        if core is None:
            build = lambda: EngineCore(config, kv_event_publisher, worker_id=worker_id)  # noqa: E731
        else:
            build = lambda: core  # noqa: E731
        self._thread = threading.Thread(target=self._run, args=(build, built), name="baton-engine", daemon=True)
        self._thread.start()
        built.result()  # raises what building raised
        self.config = self.core.config

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> AsyncLLM:
        return cls(EngineConfig.from_kwargs(model=model, **kwargs))

    # -- the API ----------------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        return self.core.tokenizer

    @property
    def is_running(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        handover: Handover | None = None,
    ) -> RequestStream:
        """Validates now (raising InvalidRequestError) and returns the request's output stream.
        `handover`: which side of a P/D handover this request is (engine/api/handover.py)."""
        self._check_alive()
        self.core.weights.check_accepting()  # asleep: refused now, not after the queue
        prepared = self.core.prepare(request_id, prompt, params, cache_salt, handover=handover)
        stream = RequestStream(request_id, self)
        with self._streams_lock:
            if request_id in self._streams:
                raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
            self._streams[request_id] = stream
        self._send(lambda: self._submit(prepared))
        return stream

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Streams outputs; a caller that stops iterating (cancel, disconnect) aborts the request."""
        stream = self.add_request(request_id, prompt, params, cache_salt)
        try:
            async for output in stream:
                yield output
        finally:
            await stream.aclose()

    @property
    def num_open_requests(self) -> int:
        """Requests added and not yet finished (running or queued)."""
        with self._streams_lock:
            return len(self._streams)

    def has_request(self, request_id: str) -> bool:
        with self._streams_lock:
            return request_id in self._streams

    def abort(self, request_id: str) -> None:
        self._send(lambda: self.core.abort_request(request_id))

    async def run_in_engine(self, fn: Callable[[EngineCore], T]) -> T:
        """Runs fn(engine_core) on the engine thread between steps and returns its result."""
        self._check_alive()
        future: concurrent.futures.Future = concurrent.futures.Future()

        def call() -> None:
            try:
                future.set_result(fn(self.core))
            except BaseException as e:  # handed to the caller
                future.set_exception(e)

        self._send(call)
        return await asyncio.wrap_future(future)

    # -- weight updates, pause, sleep (engine/weight_updates.py): between steps -------

    @property
    def weight_version(self) -> str:
        return self.core.weights.weight_version

    # Signatures and docs are WeightUpdates' own (functools.wraps), written once there.

    @functools.wraps(WeightUpdates.update_weights_from_disk)
    async def update_weights_from_disk(self, *args: Any, **kwargs: Any) -> str:
        return await self.run_in_engine(lambda c: c.weights.update_weights_from_disk(*args, **kwargs))

    @functools.wraps(WeightUpdates.update_weights_from_tensors)
    async def update_weights_from_tensors(self, *args: Any, **kwargs: Any) -> str:
        return await self.run_in_engine(lambda c: c.weights.update_weights_from_tensors(*args, **kwargs))

    @functools.wraps(WeightUpdates.prepare_weights_from_disk)
    async def prepare_weights_from_disk(self, *args: Any, **kwargs: Any) -> None:
        await self.run_in_engine(lambda c: c.weights.prepare_weights_from_disk(*args, **kwargs))

    @functools.wraps(WeightUpdates.prepare_weights_from_tensors)
    async def prepare_weights_from_tensors(self, *args: Any, **kwargs: Any) -> None:
        await self.run_in_engine(lambda c: c.weights.prepare_weights_from_tensors(*args, **kwargs))

    @functools.wraps(WeightUpdates.commit_prepared_weights)
    async def commit_prepared_weights(self, *args: Any, **kwargs: Any) -> str:
        return await self.run_in_engine(lambda c: c.weights.commit_prepared_weights(*args, **kwargs))

    @functools.wraps(WeightUpdates.discard_prepared_weights)
    async def discard_prepared_weights(self) -> None:
        await self.run_in_engine(lambda c: c.weights.discard_prepared_weights())

    @functools.wraps(WeightUpdates.init_weights_update_group)
    async def init_weights_update_group(self, *args: Any, **kwargs: Any) -> None:
        # The engine thread waits in the group's rendezvous; the event loop does not.
        await self.run_in_engine(lambda c: c.weights.init_weights_update_group(*args, **kwargs))

    @functools.wraps(WeightUpdates.update_weights_from_distributed)
    async def update_weights_from_distributed(self, *args: Any, **kwargs: Any) -> str:
        return await self.run_in_engine(lambda c: c.weights.update_weights_from_distributed(*args, **kwargs))

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self.run_in_engine(lambda c: c.weights.destroy_weights_update_group(group_name))

    async def reset_prefix_cache(self) -> bool:
        return await self.run_in_engine(lambda c: c.weights.reset_prefix_cache())

    async def pause_generation(self, mode: PauseMode = "abort") -> None:
        """Returns once the mode holds: with "wait", once every request in flight finished
        (requests added meanwhile are held until `continue_generation`)."""
        await self.run_in_engine(lambda c: c.weights.pause_generation(mode))
        if mode == "wait":
            while await self.run_in_engine(lambda c: c.has_unfinished_requests() or bool(c.weights.stashed)):
                await asyncio.sleep(_DRAIN_TICK_S)

    async def continue_generation(self) -> None:
        await self.run_in_engine(lambda c: c.weights.continue_generation())

    async def sleep(self, level: int = 1) -> None:
        await self.run_in_engine(lambda c: c.weights.sleep(level))

    async def wake_up(self) -> None:
        await self.run_in_engine(lambda c: c.weights.wake_up())

    def stats(self) -> EngineStats:
        """Snapshot taken after the latest step (thread-safe)."""
        return self._stats

    def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout=30)
        self.core.shutdown()

    # -- internals --------------------------------------------------------------------

    def _forget(self, request_id: str) -> None:
        with self._streams_lock:
            self._streams.pop(request_id, None)

    def _submit(self, prepared) -> None:
        try:
            self.core.submit(prepared)
        except InvalidRequestError as e:
            self._deliver_error(prepared.request_id, e)

    def _send(self, command: Callable[[], None]) -> None:
        self._commands.append(command)
        self._wakeup.set()

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self._dead!r}") from self._dead

    def _deliver_error(self, request_id: str, error: BaseException) -> None:
        with self._streams_lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.put(error)

    def _hand_over(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs to their readers: one wake-up per event loop, not one per request
        (each wake-up is a write to the loop's self-pipe, and the loop thread it wakes takes
        the GIL from this one while the rest are handed over)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        with self._streams_lock:
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is not None:
                    by_loop.setdefault(stream.loop, []).append((stream, output))
            for loop, items in by_loop.items():
                try:
                    loop.call_soon_threadsafe(_put_all, items)
                except RuntimeError:  # the loop was closed: nobody will read these requests
                    for stream, _ in items:
                        self._streams.pop(stream.request_id, None)
                        self.core.abort_request(stream.request_id)

    def _run(self, build: Callable[[], EngineCore], built: concurrent.futures.Future) -> None:
        try:
            self.core = build()
            self._stats = self.core.stats()
        except BaseException as e:  # handed to the constructor
            built.set_exception(e)
            return
        built.set_result(None)
        try:
            while not self._stopping:
                while self._commands:
                    self._commands.popleft()()
                if not self.core.needs_step() and not self.core.needs_polling():
                    self.core.publish_kv_events()  # an idle engine still answers snapshot requests
                    self._stats = self.core.stats()  # aborts free blocks, and warm blocks cool while idle
                    self._wakeup.wait(timeout=_IDLE_TICK_S)
                    self._wakeup.clear()
                    continue
                outputs = self.core.step()
                for request_id, error in self.core.take_failures():
                    self._deliver_error(request_id, error)
                if self.core.last_step_num_tokens == 0:  # only polling KV transfers: do not spin
                    self._wakeup.wait(timeout=_POLL_TICK_S)
                    self._wakeup.clear()
                self._stats = self.core.stats()
                if outputs:
                    self._hand_over(outputs)
        except BaseException as e:
            logger.exception("engine loop failed")
            self._dead = e
            dead = EngineDeadError(f"the engine stopped after an error: {e!r}")
            with self._streams_lock:
                for stream in self._streams.values():
                    stream.put(dead)


def _put_all(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, output in items:
        stream._queue.put_nowait(output)
