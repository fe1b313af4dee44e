"""The NIXL connector on its own: two connectors in one process, reading over UCX from DRAM.
(The engine-level handover tests in test_engine_handover.py run over NIXL too.)"""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch
from baton.services.kv_transfer.config import FaultInjection, KVTransferConfig
from baton.services.kv_transfer.connector import create_connector
from baton.services.kv_transfer.nixl_layout import CacheLayout, decode_blocks, encode_blocks

TRANSPORT = "nixl"  # for conftest.connect
SHAPE = (2, 40, 4, 2, 8)  # [K/V, blocks, block size, kv heads, head dim]


def test_missing_nixl_fails_clearly_at_start_up(monkeypatch):
    for module in ("nixl", "nixl._api", "nixl_cu12", "nixl_cu12._api"):
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    with pytest.raises(RuntimeError, match="pip install nixl-cu12.*use transport 'torch'"):
        create_connector(KVTransferConfig(role="producer", transport="nixl"), 0, torch.device("cpu"))


def test_descriptors_cover_runs_consecutive_on_both_sides():
    caches = [torch.zeros(SHAPE) for _ in range(3)]
    layout = CacheLayout.of(caches)
    block_bytes = 4 * 2 * 8 * 4
    assert (layout.num_blocks, layout.block_bytes, layout.mem_type) == (40, block_bytes, "DRAM")
    rows = layout.descriptors([(5, 3), (20, 1)])
    assert rows.shape == (3 * 2 * 2, 3)  # layers x halves x segments
    # Layer 1, V half, second segment: block 20 of the V half of layer 1's tensor.
    address, length, _ = rows[1 * 4 + 1 * 2 + 1].tolist()
    assert address == caches[1][1, 20].data_ptr() and length == block_bytes
    assert rows[0].tolist()[1] == 3 * block_bytes


def test_claims_carry_block_ids_as_runs():
    assert encode_blocks([5, 6, 7, 20, 3]) == [[5, 3], [20, 1], [3, 1]]
    assert decode_blocks(encode_blocks([5, 6, 7, 20, 3])) == (5, 6, 7, 20, 3)


def test_scattered_blocks_arrive_byte_identical_and_verified(connect, receive, outcome):
    p, d = connect(verify=True)
    src, dst = [5, 6, 7, 8, 20, 21], [30, 2, 3, 4, 9, 10]
    untouched = [kv.clone() for kv in d.kv_caches]
    p.add_leases({"t": tuple(src)})
    for round_ in range(2):  # the second reuses the connection
        receive(p, d, f"r{round_}", src, dst)
        status = outcome(d)
        assert status.finished_recving == {f"r{round_}"} and not status.failed_recving
        assert status.bytes_received == 3 * 2 * len(src) * 4 * 2 * 8 * 4
    others = [b for b in range(40) if b not in dst]
    for sent, got, before in zip(p.kv_caches, d.kv_caches, untouched):
        assert torch.equal(got[:, dst], sent[:, src])
        assert torch.equal(got[:, others], before[:, others])
    time.sleep(0.05)  # the last "done" reaches the producer
    assert p.poll().finished_sending == {"t"}


def test_claim_for_an_ended_lease_is_refused_at_once(connect, receive, outcome):
    p, d = connect(timeout_s=5.0)
    p.add_leases({"t": (1, 2)})
    p.remove_leases(["t"])
    start = time.monotonic()
    receive(p, d, "late", [1, 2], [3, 4])
    status = outcome(d)
    assert "expired" in status.failed_recving["late"]
    assert time.monotonic() - start < 2.0


def test_claim_waits_for_a_lease_not_announced_yet(connect, receive, outcome):
    """The decode may ask before the prefill runner has heard of the lease (one step later)."""
    p, d = connect()
    receive(p, d, "early", [1, 2], [3, 4])
    time.sleep(0.3)
    p.add_leases({"t": (1, 2)})
    assert outcome(d).finished_recving == {"early"}


def test_remove_leases_waits_for_a_reader(connect, receive, outcome):
    p, d = connect()
    p.set_faults(FaultInjection(delay_s=0.4))
    p.add_leases({"t": (1, 2)})
    receive(p, d, "r", [1, 2], [3, 4])
    time.sleep(0.2)  # claimed and pinned, the grant still to come
    start = time.monotonic()
    p.remove_leases(["t"])
    assert time.monotonic() - start > 0.1  # held until the decode said done
    assert outcome(d).finished_recving == {"r"}


def test_close_does_not_hang_with_a_receive_in_flight(connect, receive):
    p, d = connect(timeout_s=30.0)
    p.set_faults(FaultInjection(drop=True))
    p.add_leases({"t": (1,)})
    receive(p, d, "r", [1], [2])
    time.sleep(0.3)
    start = time.monotonic()
    closers = [threading.Thread(target=c.close) for c in (d, p)]
    for closer in closers:
        closer.start()
    for closer in closers:
        closer.join(timeout=10)
    assert time.monotonic() - start < 5.0
