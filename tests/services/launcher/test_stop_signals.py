"""`baton serve` stopped the way process managers stop it: SIGTERM to its process alone. The
request in flight finishes, the exit code is 0 within the grace period plus teardown, and no
process of its session (Ray's, its redis-server) is left. A second SIGTERM stops it at once."""

from __future__ import annotations

import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import grpc
import pytest
from baton.services.client import BatonClient
from testlib.baton_client import greedy_request
from testlib.baton_process import BatonServe, session_pids
from testlib.models import tiny_model
from testlib.waiting import wait_until

pytestmark = [pytest.mark.ray, pytest.mark.redis, pytest.mark.slow]

PROMPT = "def handle(request):\n    user = authenticate(request.headers)\n"
MAX_TOKENS = 512  # 1-2 s of decoding here: still streaming when the signal comes
LONG_TOKENS = 2000  # near the config's context limit (2048): four of them outlast a forced stop
TEARDOWN_S = 15  # Serve's, Ray's and Redis's own stop after the drain (3-5 s here)


class Stream:
    """One streaming Generate on a thread: its responses, or the error that ended it."""

    def __init__(self, address: str, max_tokens: int = MAX_TOKENS) -> None:
        self.max_tokens = max_tokens
        self.client = BatonClient(address)
        self.responses = []
        self.error: grpc.RpcError | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for response in self.client.generate(greedy_request(PROMPT, self.max_tokens), timeout=120):
                self.responses.append(response)
        except grpc.RpcError as e:
            self.error = e

    def join(self) -> None:
        self.thread.join(timeout=120)
        self.client.close()


@pytest.fixture
def workdir():
    path = Path(tempfile.mkdtemp(prefix="bt-", dir="/tmp"))  # short: Ray's socket paths live in it
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def launch(workdir):
    """`launch(grace_period_s)`: a `baton serve` this test owns; what is left of it is killed."""
    started: list[BatonServe] = []

    def start(grace_period_s: float) -> BatonServe:
        started.append(BatonServe(workdir, tiny_model("llama"), grace_period_s))
        return started[-1]

    yield start
    for serve in started:
        if serve.process.poll() is None or session_pids(serve.session_id):
            serve.kill_session()


def ready(serve: BatonServe) -> str:
    address = serve.wait_ready()
    processes = session_pids(serve.session_id).values()
    # The session holds Ray and the local Redis: the check at the end can see them go.
    assert any("redis-server" in p for p in processes) and any("raylet" in p for p in processes)
    return address


def assert_nothing_left(serve: BatonServe) -> None:
    deadline = time.monotonic() + 10  # replicas notice their raylet is gone within a moment
    while (left := session_pids(serve.session_id)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, left


def assert_signal_drains_a_stream(serve: BatonServe, address: str, sig: signal.Signals, grace_period_s: float) -> None:
    """`sig` while a greedy stream runs: the stream ends whole, `baton serve` exits 0 within
    the grace period (plus teardown) and leaves no process behind."""
    stream = Stream(address)
    wait_until(lambda: stream.responses or stream.error, timeout_s=60, what="the first token")
    signalled = time.monotonic()
    serve.signal(sig)
    stream.join()
    assert stream.error is None, stream.error
    last = stream.responses[-1]
    assert last.finish_reason == "length" and last.usage.completion_tokens == MAX_TOKENS
    assert serve.process.wait(timeout=grace_period_s + TEARDOWN_S) == 0, serve.text()
    assert time.monotonic() - signalled < grace_period_s + TEARDOWN_S
    assert f"{sig.name}: stopping (draining)" in serve.text() and "SIGTERM received" not in serve.text()
    assert_nothing_left(serve)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_signal_drains_the_stream_then_exits_0_leaving_nothing(launch, sig):
    grace_period_s = 20
    serve = launch(grace_period_s)
    address = ready(serve)
    assert_signal_drains_a_stream(serve, address, sig, grace_period_s)


def test_a_second_sigterm_stops_at_once_leaving_nothing(launch):
    grace_period_s = 60  # a drain would outlast the bound below: only the forced stop fits in it
    serve = launch(grace_period_s)
    address = ready(serve)
    streams = [Stream(address, LONG_TOKENS) for _ in range(4)]
    wait_until(lambda: all(s.responses or s.error for s in streams), timeout_s=60, what="the first tokens")
    signalled = time.monotonic()
    serve.signal(signal.SIGTERM)
    time.sleep(0.5)
    serve.signal(signal.SIGTERM)
    assert serve.process.wait(timeout=TEARDOWN_S) == 0, serve.text()
    assert time.monotonic() - signalled < TEARDOWN_S
    assert "second signal: stopping at once" in serve.text()
    for stream in streams:
        stream.join()
    # What was in flight is cut: the documented price of a forced stop.
    assert any(s.error is not None for s in streams)
    assert_nothing_left(serve)


def test_sigterm_while_starting_exits_0_leaving_nothing(launch):
    serve = launch(grace_period_s=20)
    serve.wait_for("starting Baton")
    time.sleep(1.5)  # inside ray.init here, where Ray's handlers would take the signal
    signalled = time.monotonic()
    serve.signal(signal.SIGTERM)
    assert serve.process.wait(timeout=TEARDOWN_S) == 0, serve.text()
    assert time.monotonic() - signalled < TEARDOWN_S
    assert "SIGTERM received" not in serve.text() and "Ctrl-C or SIGTERM stops" not in serve.text()
    assert_nothing_left(serve)
