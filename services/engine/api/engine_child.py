"""The engine process's side of `runner.core_process` (engine/api/engine_process.py is the
parent's): builds the core, then runs its step loop between the parent's commands.

    parent -> child   ("build", config, worker_id, sys.path)   then, any number of times:
                      ("add", request_id, prompt, params, cache_salt, handover)
                      ("abort", request_id)   ("call", call_id, cloudpickled fn)
                      ("snapshot",)   ("stop",)
    child -> parent   ("ready", facts, state) | ("build_failed", error)   then:
                      ("step", outputs, failures, state)   after each step, and when idle
                      ("result", call_id, ok, value, state)   ("dead", error)

Every message to the parent carries the core's state (stats, weight version, KV events).
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import cloudpickle

from ..config import EngineConfig
from ..core.kv_events import KVCacheSnapshot, KVEvent, KVEventPublisher
from ..errors import InvalidRequestError
from ..stats import EngineStats
from .outputs import RequestOutput
from .step_loop import Failures, run_step_loop

logger = logging.getLogger(__name__)
_PARENT_CHECK_S = 1.0


@dataclass(frozen=True)
class CoreFacts:
    """What the parent needs of the core without asking it each time."""

    config: EngineConfig
    max_model_len: int
    vocab_size: int


@dataclass
class CoreState:
    """Sent with every message: the parent's answers to `stats()` and `weight_version`."""

    stats: EngineStats
    weight_version: str
    kv_events: list[KVEvent]
    snapshot: KVCacheSnapshot | None


class _ForwardingPublisher(KVEventPublisher):
    """The child's publisher: collects events for the next message to the parent."""

    def __init__(self) -> None:
        self.events: list[KVEvent] = []
        self.snapshot: KVCacheSnapshot | None = None
        self.snapshot_wanted = False

    def publish(self, events: list[KVEvent]) -> None:
        self.events.extend(events)

    def wants_snapshot(self) -> bool:
        return self.snapshot_wanted

    def publish_snapshot(self, snapshot: KVCacheSnapshot) -> None:
        self.snapshot, self.snapshot_wanted = snapshot, False


class _Child:
    def __init__(self, conn: Connection, core: Any, publisher: _ForwardingPublisher) -> None:
        self.conn, self.core, self.publisher = conn, core, publisher
        self.failures: Failures = []  # requests refused when added
        self.prompt_sent: set[str] = set()  # requests whose prompt the parent has

    def state(self) -> CoreState:
        publisher = self.publisher
        events, publisher.events = publisher.events, []
        snapshot, publisher.snapshot = publisher.snapshot, None
        return CoreState(self.core.stats(), self.core.weights.weight_version, events, snapshot)

    def handle(self, message: tuple) -> bool:
        """One command from the parent; False on "stop"."""
        kind, core = message[0], self.core
        if kind == "add":
            _, request_id, prompt, params, cache_salt, handover = message
            try:
                core.submit(core.prepare(request_id, prompt, params, cache_salt, handover=handover))
            except InvalidRequestError as error:
                self.failures.append((request_id, error))
        elif kind == "abort":
            core.abort_request(message[1])
        elif kind == "call":
            _, call_id, fn = message
            try:
                value, ok = cloudpickle.loads(fn)(core), True
            except Exception as error:
                value, ok = error, False
            self.send_result(call_id, ok, value)
        elif kind == "snapshot":
            self.publisher.snapshot_wanted = True
            core.publish_kv_events()
        elif kind == "stop":
            return False
        return True

    def send_result(self, call_id: int, ok: bool, value: Any) -> None:
        try:
            self.conn.send(("result", call_id, ok, value, self.state()))
        except Exception as error:  # the value (or exception) does not pickle
            failure = RuntimeError(f"the engine call's {'result' if ok else 'error'} cannot be sent: {error!r}")
            self.conn.send(("result", call_id, False, failure, self.state()))

    def run(self) -> None:
        run_step_loop(self.core, self.run_commands, self.send_step)

    def run_commands(self, timeout: float) -> bool:
        """Every command the parent has sent (waiting up to `timeout` for one); False on "stop"."""
        conn = self.conn
        if conn.poll(timeout):
            while True:
                if not self.handle(conn.recv()):
                    return False
                if not conn.poll(0):
                    break
        return True

    def send_step(self, outputs: list[RequestOutput], step_failures: Failures) -> None:
        failures, self.failures = self.failures + step_failures, []
        for output in outputs:  # the prompt crosses once (EngineProcess._restore_prompts)
            if output.request_id in self.prompt_sent:
                output.prompt = output.prompt_token_ids = None
            else:
                self.prompt_sent.add(output.request_id)
            if output.finished:
                self.prompt_sent.discard(output.request_id)
        for request_id, _ in failures:
            self.prompt_sent.discard(request_id)
        self.conn.send(("step", outputs, failures, self.state()))


def environment() -> dict[str, str]:
    """The child's environment: the CPU kernels' own thread pool on, and OpenMP's workers
    passive beside it (kernels/csrc/thread_pool.h says why), unless the environment already
    says otherwise. The child shares its cores with the serving layer, where OpenMP's
    barriers cost the most (docs/benchmarks.md, session 26, has the A/B)."""
    env = dict(os.environ)
    if env.setdefault("BATON_CPU_THREAD_POOL", "1") == "1":
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def _die_with_parent() -> None:
    """Exits when the parent does, even while the model loads (no socket read then). Not
    PR_SET_PDEATHSIG: that fires when the thread that started us ends, which may be a pool's."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:  # an orphan is adopted by another process
            time.sleep(_PARENT_CHECK_S)
        os._exit(1)

    threading.Thread(target=watch, name="baton-parent-watch", daemon=True).start()


def main(fd: int) -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which stops us
    conn = Connection(fd)
    _, config, worker_id, path = conn.recv()
    # The parent's import path: calls pickle their functions by module name (a test's, say).
    sys.path.extend(p for p in path if p not in sys.path)
    from ..engine_core import EngineCore  # after the socket is ours: imports take seconds

    publisher = _ForwardingPublisher()
    try:
        core = EngineCore(config, publisher, worker_id=worker_id)
    except BaseException as error:
        try:
            conn.send(("build_failed", error))
        except Exception:
            conn.send(("build_failed", RuntimeError(f"building the engine failed: {error!r}")))
        raise
    facts = CoreFacts(core.config, core.max_model_len, core.arch.vocab_size)
    child = _Child(conn, core, publisher)
    conn.send(("ready", facts, child.state()))
    try:
        child.run()
    except (EOFError, OSError):  # the parent went away
        pass
    except BaseException as error:
        logger.exception("engine loop failed")
        try:
            conn.send(("dead", error))
        except Exception:
            conn.send(("dead", RuntimeError(f"the engine loop failed: {error!r}")))
    finally:
        core.shutdown()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The module proper, not this `__main__` copy: the classes it sends must unpickle as its.
    importlib.import_module(__spec__.name).main(int(sys.argv[1]))
