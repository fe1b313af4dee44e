"""The NIXL connector on its own (reading over UCX from DRAM), beyond what test_connectors.py
checks on every transport. (The engine-level handover tests in test_engine_handover.py run
over NIXL too.)"""

from __future__ import annotations

import sys
import time

import pytest
import torch
from baton.services.kv_transfer.config import FaultInjection, KVTransferConfig
from baton.services.kv_transfer.connector import create_connector
from baton.services.kv_transfer.nixl_layout import CacheLayout, decode_blocks, encode_blocks


@pytest.fixture
def transport() -> str:  # narrows conftest.connect to this transport
    return "nixl"


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


def _first_round(p, d, receive, outcome):
    """One handover, so the consumer knows the producer's cache layout from its grant."""
    p.add_leases({"t0": (1, 2)})
    receive(p, d, "r0", [1, 2], [3, 4], transfer_id="t0")
    assert outcome(d).finished_recving == {"r0"}


def test_a_known_producer_is_read_before_its_grant_which_still_decides(connect, receive, outcome):
    p, d = connect(verify=True)
    _first_round(p, d, receive, outcome)
    p.set_faults(FaultInjection(delay_s=0.5))
    p.add_leases({"t": (5, 6)})
    receive(p, d, "r", [5, 6], [7, 8])
    time.sleep(0.25)  # the grant is held back; the READ is not
    assert torch.equal(d.kv_caches[2][:, [7, 8]], p.kv_caches[2][:, [5, 6]])
    assert d.has_pending()
    status = outcome(d)
    assert status.finished_recving == {"r"} and not status.failed_recving


def test_an_early_read_of_an_ended_lease_fails_on_the_refusal(connect, receive, outcome):
    p, d = connect(timeout_s=5.0)
    _first_round(p, d, receive, outcome)
    p.add_leases({"t": (5, 6)})
    p.remove_leases(["t"])
    receive(p, d, "late", [5, 6], [7, 8])
    assert "expired" in outcome(d).failed_recving["late"]
    p.add_leases({"t2": (5, 6)})
    receive(p, d, "next", [5, 6], [7, 8], transfer_id="t2")
    assert outcome(d).finished_recving == {"next"}


def test_an_early_read_with_a_wrong_checksum_fails(connect, receive, outcome):
    p, d = connect(verify=True)
    _first_round(p, d, receive, outcome)
    p.set_faults(FaultInjection(corrupt=True))
    p.add_leases({"t": (5, 6)})
    receive(p, d, "r", [5, 6], [7, 8])
    assert "checksum mismatch" in outcome(d).failed_recving["r"]


def test_an_early_read_from_a_layout_that_changed_fails(connect, receive, outcome):
    """Engines register their caches once; should a producer re-register, a READ made from
    the layout of its earlier grant must not count."""
    p, d = connect()
    _first_round(p, d, receive, outcome)
    p.register_kv_caches([torch.randn(SHAPE) for _ in range(3)])  # new memory: new bases
    p.add_leases({"t": (5, 6)})
    receive(p, d, "r", [5, 6], [7, 8])
    assert "layout changed" in outcome(d).failed_recving["r"]
