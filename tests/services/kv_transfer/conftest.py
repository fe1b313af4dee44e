"""Connector pairs for the transport tests: `connect` builds a producer and a consumer over
`transport` (both transports, unless a test module overrides the fixture), in one process;
`receive` and `outcome` drive a transfer."""

from __future__ import annotations

import time

import pytest
import torch
from baton.services.kv_transfer.config import KVTransferConfig
from baton.services.kv_transfer.factory import create_connector
from baton.services.kv_transfer.nixl_agent import load_nixl
from baton.services.kv_transfer.types import KVRecvTask, KVTransferParams, KVTransferStatus

CACHE_SHAPE = (2, 40, 4, 2, 8)  # [K/V, blocks, block size, kv heads, head dim], 3 layers


@pytest.fixture(params=["torch", "nixl"])
def transport(request) -> str:
    return request.param


@pytest.fixture
def connect(transport):
    """Makes a producer and a consumer connector with registered caches; closes them afterwards."""
    if transport == "nixl":
        try:
            load_nixl()
        except RuntimeError as error:
            pytest.skip(str(error))
    made = []

    def make(**settings):
        config = {"host": "127.0.0.1", "transport": transport, "allow_fault_injection": True, **settings}
        p = create_connector(KVTransferConfig(role="prefill", **config), 0, torch.device("cpu"))
        d = create_connector(KVTransferConfig(role="decode", **config), 0, torch.device("cpu"))
        made.extend([p, d])
        torch.manual_seed(0)
        p.register_kv_caches([torch.randn(CACHE_SHAPE) for _ in range(3)])
        d.register_kv_caches([torch.zeros(CACHE_SHAPE) for _ in range(3)])
        return p, d

    yield make
    for connector in made:
        connector.close()


def _receive(p, d, request_id: str, src, dst, transfer_id: str = "t") -> None:
    params = KVTransferParams(transfer_id, "prefill", (p.endpoint,), tuple(src), 16 * len(src), 16, 1)
    d.start_recv(KVRecvTask(request_id, params, tuple(src), tuple(dst)))


def _outcome(connector, timeout_s: float = 10.0) -> KVTransferStatus:
    deadline = time.monotonic() + timeout_s
    while connector.has_pending():
        assert time.monotonic() < deadline, "receive still pending"
        time.sleep(0.001)
    return connector.poll()


@pytest.fixture
def receive():
    """receive(p, d, request_id, src, dst, transfer_id="t"): the consumer starts fetching."""
    return _receive


@pytest.fixture
def outcome():
    """outcome(connector, timeout_s=10.0): waits out the receives in flight, then polls."""
    return _outcome
