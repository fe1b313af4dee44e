"""The torch.distributed connector on its own, beyond what test_connectors.py checks on every
transport. (The engine-level handover tests in test_engine_handover.py run over it too.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from baton.services.kv_transfer.config import FaultInjection


@pytest.fixture
def transport() -> str:  # narrows conftest.connect to this transport
    return "torch"


def test_corrupted_transfer_fails_in_verify_mode_and_the_pair_recovers(connect, receive, outcome):
    p, d = connect(verify=True, timeout_s=1.0)
    p.add_leases({"t": (1, 2)})
    p.set_faults(FaultInjection(corrupt=True))
    receive(p, d, "bad", [1, 2], [3, 4])
    assert "checksum" in outcome(d).failed_recving["bad"]
    # The producer may still await the first ack: the next generation is a group of its own.
    p.set_faults(FaultInjection())
    receive(p, d, "good", [1, 2], [3, 4])
    assert outcome(d).finished_recving == {"good"}
    assert torch.equal(d.kv_caches[2][:, [3, 4]], p.kv_caches[2][:, [1, 2]])


def _listening_addresses(pid: int) -> set[str]:
    """The local addresses of `pid`'s listening TCP sockets (from /proc: inode -> address)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                listening.add(fields[1])
    return listening


def test_every_socket_listens_on_the_configured_host_only(connect, receive, outcome):
    before = _listening_addresses(os.getpid())
    p, d = connect()
    p.add_leases({"t": (1, 2)})
    receive(p, d, "t", [1, 2], [3, 4])  # the pair's gloo group listens too
    assert outcome(d).finished_recving == {"t"}
    opened = _listening_addresses(os.getpid()) - before
    assert opened, "the connectors opened no listening socket"
    loopback = "0100007F"  # 127.0.0.1 as /proc/net/tcp writes it (little-endian hex)
    assert all(address.startswith(loopback + ":") for address in opened), opened
