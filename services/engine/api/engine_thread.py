"""The engine core on a thread of the caller's process: AsyncLLM's default backend.

One thread owns the `EngineCore` and runs its step loop; callers hand it commands (submit,
abort, run-a-function) through a queue it drains between steps. The other backend,
engine/api/engine_process.py, runs the same loop in a child process; both answer AsyncLLM
through the same methods and callbacks.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from ..config import EngineConfig
from ..core.kv_events import KVEventPublisher
from ..engine_core import EngineCore
from ..errors import InvalidRequestError
from ..stats import EngineStats
from .input_processor import PreparedRequest
from .outputs import RequestOutput
from .step_loop import Failures, run_step_loop

logger = logging.getLogger(__name__)


class EngineThread:
    """`on_outputs(outputs)`, `on_error(request_id, error)` and `on_dead(error)` are called
    on the engine thread."""

    def __init__(
        self,
        config: EngineConfig,
        publisher: KVEventPublisher | None,
        core: EngineCore | None,
        worker_id: str,
        on_outputs: Callable[[list[RequestOutput]], None],
        on_error: Callable[[str, BaseException], None],
        on_dead: Callable[[BaseException], None],
    ) -> None:
        self._on_outputs, self._on_error, self._on_dead = on_outputs, on_error, on_dead
        self._commands: deque[Callable[[], None]] = deque()
        self._wakeup = threading.Event()
        self._stopping = False
        # The engine thread builds the core itself: the thread that loads the model is the
        # one whose OpenMP team runs it (model/cpu_tuning.py says why that matters).
        built: concurrent.futures.Future[None] = concurrent.futures.Future()
        if core is None:
            build = lambda: EngineCore(config, publisher, worker_id=worker_id)  # noqa: E731
        else:
            build = lambda: core  # noqa: E731
        self._thread = threading.Thread(target=self._run, args=(build, built), name="baton-engine", daemon=True)
        self._thread.start()
        built.result()  # raises what building raised
        self.config, self.max_model_len = self.core.config, self.core.max_model_len
        self.vocab_size = self.core.arch.vocab_size

    @property
    def tokenizer(self) -> Any:
        return self.core.tokenizer

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def weight_version(self) -> str:
        return self.core.weights.weight_version

    def stats(self) -> EngineStats:
        return self._stats

    def prepare(self, request_id: str, prompt: Any, params: Any, cache_salt: str | None, handover: Any) -> Any:
        """Validates now, on the caller's thread (raising InvalidRequestError)."""
        self.core.weights.check_accepting()  # asleep: refused now, not after the queue
        return self.core.prepare(request_id, prompt, params, cache_salt, handover=handover)

    def submit(self, prepared: PreparedRequest) -> None:
        self._send(lambda: self._submit(prepared))

    def abort(self, request_id: str) -> None:
        self._send(lambda: self.core.abort_request(request_id))

    def call(self, fn: Callable[[EngineCore], Any]) -> concurrent.futures.Future:
        """Runs fn(core) on the engine thread between steps; the future holds its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def call() -> None:
            try:
                future.set_result(fn(self.core))
            except BaseException as e:  # handed to the caller
                future.set_exception(e)

        self._send(call)
        return future

    def shutdown(self) -> None:
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout=30)
        self.core.shutdown()

    # -- internals --------------------------------------------------------------------

    def _submit(self, prepared: PreparedRequest) -> None:
        try:
            self.core.submit(prepared)
        except InvalidRequestError as e:
            self._on_error(prepared.request_id, e)

    def _send(self, command: Callable[[], None]) -> None:
        self._commands.append(command)
        self._wakeup.set()

    def _run(self, build: Callable[[], EngineCore], built: concurrent.futures.Future) -> None:
        try:
            self.core = core = build()
            self._stats = core.stats()
        except BaseException as e:  # handed to the constructor
            built.set_exception(e)
            return
        built.set_result(None)
        try:
            run_step_loop(core, self._run_commands, self._report)
        except BaseException as e:
            logger.exception("engine loop failed")
            self._on_dead(e)

    def _run_commands(self, timeout: float) -> bool:
        if timeout and not self._commands:
            self._wakeup.wait(timeout)
        self._wakeup.clear()  # before draining: a command sent after this sets it again
        while self._commands:
            self._commands.popleft()()
        return not self._stopping

    def _report(self, outputs: list[RequestOutput], failures: Failures) -> None:
        for request_id, error in failures:
            self._on_error(request_id, error)
        self._stats = self.core.stats()
        if outputs:
            self._on_outputs(outputs)
