"""The local redis-server of `baton serve` (and of benchmarks): loopback only, a free port,
no persistence, supervised for the life of the server.

    start       one thread (the supervisor) starts the server and waits for PONG; a server
                that does not come up raises here, with nothing left running
    supervise   the same thread then blocks in wait(): a death is reaped at once (no zombie),
                logged with its exit status, and the server started again on the same port,
                at most `max_restarts` times per `restart_window_s`. It comes back empty: the
                workers notice, register again and republish their blocks (worker_agent.py)
    stop        idempotent; no restart after it, even one already under way

Every server runs in a process group of its own (in the same session): Ctrl-C signals the
terminal's foreground group, and Redis must outlive the drain that follows, not die with the
keystroke and be restarted. It is started under `setpriv --pdeathsig TERM` where util-linux
has it: the kernel sends it SIGTERM when the thread that started it (the supervisor) dies, so
a `kill -9` of `baton serve`, or any exit that skips `stop`, still leaves no redis-server.

Optionally secured: `username` makes an ACL user with a generated password (kept in memory,
written only as its SHA-256 into an ACL file of mode 0600, never on a command line), allowed
the keys under `key_prefix` and no dangerous commands; the default user is off. `tls` serves
a TLS port only (the plaintext port is off). `redis_config` and `environment` give the clients
the matching settings (the password travels in BATON_REDIS_PASSWORD, the config names no secret).
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import secrets
import shutil
import signal
import subprocess
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from .ports import free_port

logger = logging.getLogger(__name__)

DEFAULT_MAX_RESTARTS = 5
DEFAULT_RESTART_WINDOW_S = 60.0
START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0
RETRY_DELAY_S = 0.5  # after a restart that did not come up (the port taken meanwhile, say)


PASSWORD_ENV = "BATON_REDIS_PASSWORD"  # RedisConfig.password_env's default


@dataclass(frozen=True, slots=True)
class RedisTLS:
    """The local server's certificate and key, and the CA clients verify it with (which also
    signs the client certificates it accepts; clients need none)."""

    cert_file: str
    key_file: str
    ca_file: str


class LocalRedis:
    def __init__(
        self,
        workdir: Path,
        port: int | None = None,
        max_restarts: int = DEFAULT_MAX_RESTARTS,
        restart_window_s: float = DEFAULT_RESTART_WINDOW_S,
        username: str | None = None,
        key_prefix: str = "baton",
        tls: RedisTLS | None = None,
    ) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RuntimeError(
                "redis-server was not found on PATH: install it (apt-get install redis-server) "
                "or set router.redis.url in the config"
            )
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self.username = username
        self.password = secrets.token_urlsafe(32) if username is not None else None
        self.key_prefix = key_prefix
        self.tls = tls
        self.num_restarts = 0  # servers started after the first
        self.exit_statuses: list[int] = []  # of the servers that died under it (Popen.returncode)
        self._process: subprocess.Popen | None = None
        self._lock = threading.Lock()  # orders a start against a stop
        self._stopping = threading.Event()
        started: Future[None] = Future()
        self._thread = threading.Thread(
            target=self._supervise, args=(started,), name=f"baton-redis-{self.port}", daemon=True
        )
        self._thread.start()
        try:
            started.result()
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}"

    def redis_config(self):
        """The router's RedisConfig for this server (the password comes from `environment()`)."""
        from ..router.config import RedisConfig

        tls = {} if self.tls is None else {"tls_ca_file": self.tls.ca_file}
        return RedisConfig(url=self.url, username=self.username, password_env=PASSWORD_ENV, **tls)

    def environment(self) -> dict[str, str]:
        """What every client process needs in its environment: the ACL user's password, if any."""
        return {} if self.password is None else {PASSWORD_ENV: self.password}

    def client(self, **kwargs) -> redis.Redis:
        """A client with this server's user and TLS, without retries (keyword arguments win)."""
        settings: dict = {"username": self.username, "password": self.password, "retry": Retry(NoBackoff(), 0)}
        if self.tls is not None:
            settings |= {"ssl": True, "ssl_ca_certs": self.tls.ca_file}
        return redis.Redis(host="127.0.0.1", port=self.port, **(settings | kwargs))

    @property
    def pid(self) -> int | None:
        """The running server's process id (None once stopped or given up on)."""
        process = self._process
        return process.pid if process is not None and process.returncode is None else None

    @property
    def log_path(self) -> Path:
        return self.workdir / "redis.log"

    def stop(self) -> None:
        """Stops the server (SIGTERM, then SIGKILL after STOP_TIMEOUT_S) and the supervisor."""
        with self._lock:
            self._stopping.set()
            process = self._process
        if process is not None and process.returncode is None:
            process.terminate()
            try:
                process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=STOP_TIMEOUT_S)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=STOP_TIMEOUT_S)

    # -- the supervisor thread --------------------------------------------------------

    def _supervise(self, started: Future[None]) -> None:
        try:
            self._start_server()
        except BaseException as e:
            started.set_exception(e)
            return
        started.set_result(None)
        restarts: collections.deque[float] = collections.deque()  # when each restart began, in the window
        while True:
            process = self._process
            status = process.wait()  # blocks until it dies: reaped and noticed at once
            if self._stopping.is_set():
                return
            self.exit_statuses.append(status)
            logger.warning(
                "the local redis-server (pid %d, port %d) %s; see %s",
                process.pid,
                self.port,
                describe_exit(status),
                self.log_path,
            )
            if not self._restart(restarts):
                return

    def _restart(self, restarts: collections.deque[float]) -> bool:
        """Starts the server again on its port, retrying one that does not come up (the port
        taken meanwhile, say); False once the budget is spent or a stop came."""
        while True:
            now = time.monotonic()
            while restarts and restarts[0] <= now - self.restart_window_s:
                restarts.popleft()
            if len(restarts) >= self.max_restarts:
                logger.error(
                    "the local redis-server was restarted %d times within %g s: not starting it again "
                    "(the router places requests by load only until Redis is back)",
                    len(restarts),
                    self.restart_window_s,
                )
                return False
            restarts.append(now)
            try:
                self._start_server()
            except (RuntimeError, OSError) as e:  # OSError: its folder or binary went away
                if self._stopping.is_set():
                    return False
                logger.error("the local redis-server did not come back on port %d: %s", self.port, e)
                if self._stopping.wait(RETRY_DELAY_S):
                    return False
                continue
            if self._stopping.is_set():
                return False
            self.num_restarts += 1
            logger.warning(
                "the local redis-server is back on port %d (pid %d, restart %d); it starts empty and the "
                "workers republish their blocks",
                self.port,
                self._process.pid,
                self.num_restarts,
            )
            return True

    def _start_server(self) -> None:
        with self._lock:
            if self._stopping.is_set():
                raise RuntimeError("the local redis-server is stopping")
            with self.log_path.open("a") as log:
                self._process = subprocess.Popen(
                    self._command(),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    process_group=0,  # a terminal's Ctrl-C reaches `baton serve`, which stops it in order
                )
        self._wait_ready(self._process)

    def _command(self) -> list[str]:
        server = [
            self.binary,
            "--bind", "127.0.0.1",
            "--dir", str(self.workdir),
            "--save", "",
            "--appendonly", "no",
            "--protected-mode", "yes",
        ]  # fmt: skip
        if self.tls is None:
            server += ["--port", str(self.port)]
        else:
            server += ["--port", "0", "--tls-port", str(self.port), "--tls-auth-clients", "optional"]
            server += ["--tls-cert-file", self.tls.cert_file, "--tls-key-file", self.tls.key_file]
            server += ["--tls-ca-cert-file", self.tls.ca_file]
        if self.username is not None:
            server += ["--aclfile", str(self._write_acl_file())]
        setpriv = shutil.which("setpriv")
        return [setpriv, "--pdeathsig", "TERM", "--", *server] if setpriv else server

    def _wait_ready(self, process: subprocess.Popen, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(
                    f"redis-server exited at start-up ({describe_exit(process.returncode)}); see {self.log_path}"
                )
            if self._stopping.is_set():
                return  # stop() ends it
            if self._answers_ping():
                return
            time.sleep(0.01)
        process.kill()
        process.wait(timeout=STOP_TIMEOUT_S)
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout_s:g}s")

    def _answers_ping(self) -> bool:
        try:
            with self.client(socket_timeout=0.2, socket_connect_timeout=0.2) as client:
                return client.ping()
        except redis.RedisError:
            return False

    def _write_acl_file(self) -> Path:
        """`users.acl`: the default user off; ours with the password's SHA-256, its keys, no
        dangerous commands. Mode 0600 from the start."""
        path = self.workdir / "users.acl"
        digest = hashlib.sha256(self.password.encode()).hexdigest()
        text = f"user default off\nuser {self.username} on #{digest} ~{self.key_prefix}:* +@all -@dangerous\n"
        path.unlink(missing_ok=True)
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as acl:
            acl.write(text)
        return path


def describe_exit(returncode: int) -> str:
    """`exited with status 1` or `was killed by SIGKILL` (Popen's negative return codes)."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with status {returncode}"
