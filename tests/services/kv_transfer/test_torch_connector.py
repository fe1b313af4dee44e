"""The torch.distributed connector on its own, beyond what test_connectors.py checks on every
transport. (The engine-level handover tests in test_engine_handover.py run over it too.)"""

from __future__ import annotations

import os

import pytest
import torch
from baton.services.kv_transfer.config import FaultInjection
from testlib.sockets import listening_addresses


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


def test_every_socket_listens_on_the_configured_host_only(connect, receive, outcome):
    before = listening_addresses({os.getpid()})
    p, d = connect()
    p.add_leases({"t": (1, 2)})
    receive(p, d, "t", [1, 2], [3, 4])  # the pair's gloo group listens too
    assert outcome(d).finished_recving == {"t"}
    opened = listening_addresses({os.getpid()}) - before
    assert opened, "the connectors opened no listening socket"
    assert {ip for ip, _ in opened} == {"127.0.0.1"}, opened
