"""The asynchronous engine the services wrap: streams outputs to asyncio callers.

A backend owns the `EngineCore` and runs its step loop: a thread of this process
(engine/api/engine_thread.py, the default) or, with `runner.core_process`, a child process
(engine/api/engine_process.py says why). Asyncio callers hand it commands (add, abort,
run-a-function) and receive outputs on per-request asyncio queues. A step never blocks the
caller's event loop, and one loop serves every request, exactly as `LLM.generate` does
offline. Both backends take the same API, except that `core` is reachable only on a thread
(`run_in_engine` on either).

    caller (event loop)                       engine thread (or process)
    generate() -> prepare() ---- add ---->    submit(); step(); step(); ...
      <------------- outputs via call_soon_threadsafe ----
    (cancelled) ---------------- abort --->   abort_request() frees the blocks
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from ..config import EngineConfig
from ..core.kv_events import KVEventPublisher
from ..engine_core import EngineCore
from ..errors import EngineDeadError, InvalidRequestError
from ..stats import EngineStats
from ..weight_updates import PauseMode, WeightUpdates
from .engine_process import EngineProcess
from .engine_thread import EngineThread
from .handover import Handover
from .outputs import RequestOutput, merge_deltas
from .sampling_params import RequestOutputKind, SamplingParams

T = TypeVar("T")
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
        self._streams: dict[str, RequestStream] = {}
        self._streams_lock = threading.Lock()
        self._dead: BaseException | None = None
        deliver = (self._hand_over, self._deliver_error, self._die)
        self._engine: EngineThread | EngineProcess
        if config.runner.core_process:
            if core is not None:
                raise ValueError("an EngineCore handed to AsyncLLM runs on a thread: turn runner.core_process off")
            self._engine = EngineProcess(config, worker_id, kv_event_publisher, *deliver)
        else:
            self._engine = EngineThread(config, kv_event_publisher, core, worker_id, *deliver)
        self.config, self.max_model_len = self._engine.config, self._engine.max_model_len
        self.vocab_size = self._engine.vocab_size

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> AsyncLLM:
        return cls(EngineConfig.from_kwargs(model=model, **kwargs))

    # -- the API ----------------------------------------------------------------------

    @property
    def core(self) -> EngineCore:
        """The engine core, on a thread of this process (not with `runner.core_process`)."""
        return self._engine.core

    @property
    def tokenizer(self) -> Any:
        return self._engine.tokenizer

    @property
    def is_running(self) -> bool:
        return self._dead is None and self._engine.is_alive

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        handover: Handover | None = None,
    ) -> RequestStream:
        """Validates now (raising InvalidRequestError) and returns the request's output stream;
        with `runner.core_process` the engine's process validates, and the stream ends with
        its error. `handover`: which side of a P/D handover this request is (handover.py)."""
        self._check_alive()
        prepared = self._engine.prepare(request_id, prompt, params, cache_salt, handover)
        stream = RequestStream(request_id, self)
        with self._streams_lock:
            if request_id in self._streams:
                raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
            self._streams[request_id] = stream
        try:
            self._engine.submit(prepared)
        except BaseException:
            self._forget(request_id)
            raise
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
        if self._dead is None:  # a dead engine has nothing left to free
            self._engine.abort(request_id)

    async def run_in_engine(self, fn: Callable[[EngineCore], T]) -> T:
        """Runs fn(engine_core) between steps and returns its result (with `runner.core_process`
        in the engine's process: fn and its result cross pickled)."""
        self._check_alive()
        return await asyncio.wrap_future(self._engine.call(fn))

    # -- weight updates, pause, sleep (engine/weight_updates.py): between steps -------

    @property
    def weight_version(self) -> str:
        return self._engine.weight_version

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
        return self._engine.stats()

    def shutdown(self) -> None:
        self._engine.shutdown()

    # -- internals --------------------------------------------------------------------

    def _forget(self, request_id: str) -> None:
        with self._streams_lock:
            self._streams.pop(request_id, None)

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
                        self._engine.abort(stream.request_id)

    def _die(self, error: BaseException) -> None:
        """The engine stopped: every open request fails."""
        self._dead = error
        dead = EngineDeadError(f"the engine stopped after an error: {error!r}")
        with self._streams_lock:
            for stream in self._streams.values():
                stream.put(dead)


def _put_all(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, output in items:
        stream._queue.put_nowait(output)
