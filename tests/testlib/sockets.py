"""Which TCP addresses processes listen on, read from /proc (no psutil here)."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

_LISTEN = "0A"


def addresses_listening_on(port: int) -> set[str]:
    """The IPs that sockets listening on `port` are bound to, whoever holds them."""
    return {ip for ip, bound_port, _ in _listening() if bound_port == port}


def listening_addresses(pids: set[int]) -> set[tuple[str, int]]:
    """(IP, port) of every listening TCP socket the processes `pids` hold."""
    inodes = set()
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    return {(ip, port) for ip, port, inode in _listening() if inode in inodes}


def _listening() -> list[tuple[str, int, str]]:
    """(IP, port, socket inode) of every listening TCP socket on the machine."""
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == _LISTEN:
                listening.append((*_decoded(fields[1]), fields[9]))
    return listening


def _decoded(address: str) -> tuple[str, int]:
    """/proc/net/tcp's "0100007F:1F90" -> ("127.0.0.1", 8080): 32-bit words in host order."""
    ip_hex, port_hex = address.split(":")
    raw = b"".join(bytes.fromhex(ip_hex[i : i + 8])[::-1] for i in range(0, len(ip_hex), 8))
    ip = ipaddress.ip_address(raw)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), int(port_hex, 16)
