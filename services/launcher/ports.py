"""The ports `baton serve` listens on, checked before anything starts.

A port someone else holds would otherwise surface deep inside Ray (a 40-line traceback from
Serve's proxy, after Ray and the local Redis are up); checked first, it is one line naming the
port, the config key and the flag, and nothing has been started. The checks bind where the
servers will: HTTP on `server.http_host`, Serve's gRPC proxy on `server.grpc_host` (Baton's
proxy hook binds it there, services/gateway/tls.py), Ray's metrics exporter on loopback (the local Ray's node address). SO_REUSEADDR
lets a port whose last connections linger in TIME_WAIT pass, as the real servers would; a
listening socket still fails the bind.
"""

from __future__ import annotations

import errno
import random
import re
import socket
from collections.abc import Collection
from pathlib import Path

from ..config import ServerConfig

# config key -> the `baton serve` flag that sets it
FLAGS = {"server.http_port": "--http-port", "server.grpc_port": "--grpc-port", "server.metrics_port": "--metrics-port"}
_RAY_BIND_ERROR = re.compile(r"Failed to bind to address \S*?:(\d+)")
# Ray's workers listen on 10002-19999 (its min/max_worker_port); its other servers, and every
# outgoing connection's local end, take ports from the kernel's ephemeral range. A port picked
# in either before ray.init can be taken by the time a replica binds it, seconds later.
_RAY_WORKER_PORTS_END = 20000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_PICK_TRIES = 100


class PortInUse(RuntimeError):
    def __init__(self, port: int, key: str) -> None:
        super().__init__(port, key)
        self.port = port
        self.key = key  # the config key that chose it, e.g. server.grpc_port

    def __str__(self) -> str:
        flag = FLAGS.get(self.key)
        change = f"{flag} N or --set {self.key}=N" if flag else f"--set {self.key}=N"
        return (
            f"port {self.port} ({self.key}) is already in use: stop what listens there or choose another with {change}"
        )


def ports_to_check(server: ServerConfig, metrics_port: int | None) -> list[tuple[str, str, int]]:
    """(config key, bind host, port) for each fixed port; 0 (a free port, picked later) is not checked."""
    wanted = [
        ("server.http_port", server.http_host, server.http_port),
        ("server.grpc_port", server.grpc_host, server.grpc_port),
        ("server.metrics_port", "127.0.0.1", metrics_port or 0),
    ]
    return [(key, host, port) for key, host, port in wanted if port]


def check_ports_free(server: ServerConfig, metrics_port: int | None) -> None:
    """Raises PortInUse for the first port that is taken, or that two keys share."""
    seen: dict[int, str] = {}
    for key, host, port in ports_to_check(server, metrics_port):
        if port in seen:
            raise ValueError(f"{seen[port]} and {key} are both {port}: give each its own port")
        seen[port] = key
        if not can_bind(host, port):
            raise PortInUse(port, key)


def free_listen_port(host: str = "127.0.0.1", avoid: Collection[int] = ()) -> int:
    """A port free on `host` now, for a server started later: between Ray's worker ports and the
    kernel's ephemeral range, so Ray starting up in between does not take it (the kernel's pick
    where that gap is empty or full). Nothing binds a picked port until Ray is up, so the ports
    already picked for the other servers are passed as `avoid`: the same random port twice
    would put HTTP and gRPC on one port, and the second server would never start."""
    first_ephemeral = _first_ephemeral_port()
    if first_ephemeral > _RAY_WORKER_PORTS_END:
        for _ in range(_PICK_TRIES):
            port = random.randrange(_RAY_WORKER_PORTS_END, first_ephemeral)
            if port not in avoid and can_bind(host, port):
                return port
    for _ in range(_PICK_TRIES):
        port = free_port()
        if port not in avoid:
            return port
    raise RuntimeError(f"no free port on {host} outside {sorted(avoid)}")


def free_port() -> int:
    """The kernel's pick of a free loopback port, for a server that binds it at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _first_ephemeral_port() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: the IANA range's start
        return 49152


def can_bind(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError:  # no IPv6 here: the gRPC proxy then binds IPv4 only
        return can_bind("0.0.0.0", port) if family == socket.AF_INET6 else True
    with sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        try:
            sock.bind((host, port))
            sock.listen(1)
        except OSError as e:
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def port_in_use_from(error: BaseException, server: ServerConfig, metrics_port: int | None) -> PortInUse | None:
    """Serve's proxies report a port taken after the check (a race) as a RuntimeError with
    "Failed to bind to address HOST:PORT": the same PortInUse, or None for other errors."""
    match = _RAY_BIND_ERROR.search(str(error))
    if match is None:
        return None
    port = int(match.group(1))
    keys = {p: key for key, _, p in ports_to_check(server, metrics_port)}
    return PortInUse(port, keys.get(port, "server.http_port or server.grpc_port"))
