"""How `baton serve` stops on a signal: SIGTERM (what systemd, Docker and Kubernetes send),
SIGINT (Ctrl-C) and SIGHUP (its terminal went away) all start the same orderly stop; a second
signal cuts the drain short. The handler only records and, in two phases, raises:

    phase                         first signal           second signal
    starting (before ray.init)    stop asked             forced
    starting (after ray.init)     raises StopRequested   forced, raises StopRequested
    serving                       stop asked             forced
    draining                      stop asked             forced, raises KeyboardInterrupt
    stopping (Ray, Redis)         recorded               recorded
    any, once forced              ignored                ignored

The raise leaves a start, or a drain, that could take long (a model loading, a stream
running); what follows is stopping Ray and Redis, which no signal interrupts.

Ray takes SIGTERM over in `ray.init`, twice:
- at the C level, the core worker it starts installs absl's failure-signal handler for SIGTERM
  (as for SIGSEGV), which prints a stack ("*** SIGTERM received ... clock_nanosleep") and
  re-raises; the process then dies half-way through Ray's teardown (exit 134 or 15), leaving
  the local redis-server behind. `signal.signal` after `ray.init` puts Python's own C handler
  back, so the handlers are installed again then (`install(interrupt_start=True)`).
- in Python, `ray.init` installs `sys.exit` as the SIGTERM handler while it runs; the
  SystemExit can land inside Ray's own C++ waits, and one seen here (a GCS state accessor being
  destroyed) never returns. `ray_keeps_our_sigterm_handler` keeps this class's handler instead.

Nothing here prints: a print in a handler can re-enter a print the main thread is in the middle of.
"""

from __future__ import annotations

import contextlib
import enum
import signal
import threading
from collections.abc import Iterator

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class StopRequested(Exception):
    """A stop signal arrived while Baton was starting: stop instead of finishing the start."""


class Phase(enum.Enum):
    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    STOPPING = "stopping"


class StopSignals:
    def __init__(self) -> None:
        self.phase = Phase.STARTING
        self.signal_name: str | None = None  # the first stop signal, for the log
        self.is_forced = False  # a second signal: no drain, stop at once
        self._requested = threading.Event()
        self._interrupts_start = False

    @property
    def is_requested(self) -> bool:
        return self._requested.is_set()

    def install(self, interrupt_start: bool = False) -> None:
        """(Re-)installs the handlers (from the main thread). With `interrupt_start`, a signal
        during the rest of the start raises StopRequested, and one that came already raises it
        now."""
        for sig in SIGNALS:
            signal.signal(sig, self._handle)
        self._interrupts_start = interrupt_start
        if interrupt_start and self.phase is Phase.STARTING and self.is_requested:
            raise StopRequested(self.signal_name)

    def serving(self) -> None:
        self.phase = Phase.SERVING

    def draining(self) -> None:
        """From here a second signal raises KeyboardInterrupt out of the drain."""
        self.phase = Phase.DRAINING

    def stopping(self) -> None:
        """From here signals are only recorded: stopping Ray and Redis must not be cut short."""
        self.phase = Phase.STOPPING

    def wait(self, timeout_s: float | None = None) -> bool:
        """True once a stop was asked for."""
        return self._requested.wait(timeout_s)

    def _handle(self, signum: int, frame) -> None:
        if self.is_forced:
            return
        if self.is_requested:
            self.is_forced = True
        else:
            self.signal_name = signal.Signals(signum).name
            self._requested.set()
        if self.phase is Phase.STARTING and self._interrupts_start:
            raise StopRequested(self.signal_name)
        if self.phase is Phase.DRAINING and self.is_forced:
            raise KeyboardInterrupt(f"{signal.Signals(signum).name} during the drain")


@contextlib.contextmanager
def ray_keeps_our_sigterm_handler() -> Iterator[None]:
    """Around `ray.init`: Ray's calls to install its own SIGTERM handler do nothing (see above)."""
    import ray._private.utils as ray_utils  # Ray 2.60's one place for it (worker.py, node.py)

    original = ray_utils.set_sigterm_handler
    ray_utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        ray_utils.set_sigterm_handler = original
