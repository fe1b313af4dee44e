"""The engine core in a process of its own (`runner.core_process`), as vLLM's EngineCoreProc.

On a thread, the step loop shares its process's GIL with the serving layer: the replica's
event loop, Ray's threads and the router agent. A step is mostly Python at small batches,
so every hold of the GIL beside it lengthens the step (docs/benchmarks.md measured a
thread's share costing the step twice what the same share costs from another process).
Here the core and its loop run in a child process; `AsyncLLM` keeps its API and talks to
the child over a socket pair:

    parent (AsyncLLM, this module)                 child (engine_child.py)
    add / abort / call(fn) / snapshot  ------->    prepare+submit, abort, fn(core); step(); ...
    reader thread: streams, calls' results  <---   per step: outputs, failures, stats, KV events

The child tokenizes and validates, so a refused request ends its stream with the error
rather than raising from `add_request`. Calls (`run_in_engine`) cross as cloudpickle, their
results and exceptions as pickle. The router agent's publisher stays in the parent: the
child forwards its KV events, and makes a snapshot when the parent's publisher asks for one.
The child exits with its parent (it watches its parent's pid, and reads end of file).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import cloudpickle

from ..config import EngineConfig
from ..core.kv_events import KVEventPublisher
from ..errors import EngineDeadError
from ..stats import EngineStats
from . import engine_child
from .engine_child import CoreState
from .outputs import RequestOutput
from .tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class EngineProcess:
    """The parent's handle on the child, with engine_thread.EngineThread's methods.
    `on_outputs(outputs)`, `on_error(request_id, error)` and `on_dead(error)` are called on
    the reader thread."""

    def __init__(
        self,
        config: EngineConfig,
        worker_id: str,
        publisher: KVEventPublisher | None,
        on_outputs: Callable[[list[RequestOutput]], None],
        on_error: Callable[[str, BaseException], None],
        on_dead: Callable[[BaseException], None],
    ) -> None:
        self._publisher = publisher
        self._on_outputs, self._on_error, self._on_dead = on_outputs, on_error, on_dead
        self._send_lock = threading.Lock()
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._dead: BaseException | None = None
        self._stopping = False
        self._snapshot_asked = False
        self._prompts: dict[str, tuple[str | None, list[int]]] = {}  # by request: see _restore_prompts
        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", engine_child.__name__, str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            env=engine_child.environment(),
        )
        theirs.close()
        self._conn = Connection(ours.detach())
        self._send(("build", config, worker_id, sys.path))
        try:
            reply = self._conn.recv()
        except (EOFError, OSError) as e:
            self.proc.wait()
            raise RuntimeError(f"the engine process exited with {self.proc.returncode} while building") from e
        if reply[0] == "build_failed":
            self.proc.wait()
            raise reply[1]
        _, facts, self.state = reply
        self.config, self.max_model_len, self.vocab_size = facts.config, facts.max_model_len, facts.vocab_size
        self._tokenizer: Any = None
        self._reader = threading.Thread(target=self._read, name="baton-engine-reader", daemon=True)
        self._reader.start()

    @property
    def core(self) -> Any:
        raise AttributeError("the engine core runs in its own process (runner.core_process): use run_in_engine")

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:  # loaded here only when asked for: the child tokenizes
            model = self.config.model
            self._tokenizer = load_tokenizer(model.tokenizer or model.model)
        return self._tokenizer

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self.proc.poll() is None

    @property
    def weight_version(self) -> str:
        return self.state.weight_version

    def stats(self) -> EngineStats:
        return self.state.stats

    def prepare(self, request_id: str, prompt: Any, params: Any, cache_salt: str | None, handover: Any) -> tuple:
        """The child validates: a refused request's error comes back through `on_error`."""
        return (request_id, prompt, params, cache_salt, handover)

    def submit(self, prepared: tuple) -> None:
        self._send(("add", *prepared))

    def abort(self, request_id: str) -> None:
        if threading.current_thread() is self._reader:  # on_outputs found the reader's loop closed
            self._send_aside(("abort", request_id))
            return
        with contextlib.suppress(EngineDeadError):  # a dead engine has nothing left to free
            self._send(("abort", request_id))

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Runs fn(core) in the child between steps; the future holds its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        call_id = next(self._call_ids)
        self._calls[call_id] = future
        try:
            self._send(("call", call_id, cloudpickle.dumps(fn)))
        except BaseException:
            self._calls.pop(call_id, None)
            raise
        if self._dead is not None and self._calls.pop(call_id, None) is not None:
            _fail(future, self._dead_error())  # sent after the reader failed the others
        return future

    def shutdown(self, timeout_s: float = 30.0) -> None:
        self._stopping = True
        with contextlib.suppress(EngineDeadError, OSError):  # it stopped already
            self._send(("stop",))
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("the engine process did not stop within %.0f s: killing it", timeout_s)
            self.proc.kill()
            self.proc.wait()
        self._conn.close()

    # -- internals --------------------------------------------------------------------

    def _send(self, message: tuple) -> None:
        if self._dead is not None:
            raise self._dead_error()
        with self._send_lock:
            self._conn.send(message)

    def _dead_error(self) -> EngineDeadError:
        return EngineDeadError(f"the engine process stopped: {self._dead!r}")

    def _read(self) -> None:
        try:
            while True:
                message = self._conn.recv()
                kind = message[0]
                if kind == "step":
                    _, outputs, failures, self.state = message
                    self._forward_kv_events(self.state)
                    for request_id, error in failures:
                        self._prompts.pop(request_id, None)
                        self._on_error(request_id, error)
                    if outputs:
                        self._restore_prompts(outputs)
                        self._on_outputs(outputs)
                elif kind == "result":
                    _, call_id, ok, value, self.state = message
                    self._forward_kv_events(self.state)
                    future = self._calls.pop(call_id, None)
                    if future is None:  # its send failed, and the caller has that error
                        continue
                    if ok:
                        future.set_result(value)
                    else:
                        future.set_exception(value)
                elif kind == "dead":
                    raise message[1]
        except BaseException as e:  # end of file: the child exited (or was killed)
            code = self.proc.poll()
            self._dead = e if not isinstance(e, EOFError) else RuntimeError(f"engine process exited ({code})")
            if not self._stopping:
                logger.error("engine process stopped: %r", self._dead)
            while self._calls:
                _fail(self._calls.popitem()[1], self._dead_error())
            self._on_dead(self._dead)

    def _restore_prompts(self, outputs: list[RequestOutput]) -> None:
        """Outputs after a request's first come without its prompt, which is large and the
        same in every output (pickling it each step would cost the engine's loop)."""
        prompts = self._prompts
        for output in outputs:
            if output.prompt_token_ids is None:
                output.prompt, output.prompt_token_ids = prompts[output.request_id]
            else:
                prompts[output.request_id] = (output.prompt, output.prompt_token_ids)
            if output.finished:
                del prompts[output.request_id]

    def _forward_kv_events(self, state: CoreState) -> None:
        publisher = self._publisher
        if publisher is None:
            return
        if state.kv_events:
            publisher.publish(state.kv_events)
        if state.snapshot is not None:
            publisher.publish_snapshot(state.snapshot)
            self._snapshot_asked = False
        if publisher.wants_snapshot() and not self._snapshot_asked:
            self._snapshot_asked = True  # one request until its snapshot comes back
            self._send_aside(("snapshot",))

    def _send_aside(self, message: tuple) -> None:
        """Sends from the reader thread without blocking it: were the child's socket full
        (a large call being sent) while the child waits to send a step, the reader must go on
        reading, or neither side would move."""
        threading.Thread(target=self._send_quietly, args=(message,), name="baton-engine-send", daemon=True).start()

    def _send_quietly(self, message: tuple) -> None:
        with contextlib.suppress(EngineDeadError, OSError):  # nothing left to ask of a dead child
            self._send(message)


def _fail(future: concurrent.futures.Future, error: BaseException) -> None:
    with contextlib.suppress(concurrent.futures.InvalidStateError):  # failed by the other thread
        future.set_exception(error)
