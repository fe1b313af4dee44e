"""The NIXL connector on its own (reading over UCX from DRAM), beyond what test_connectors.py
checks on every transport. (The engine-level handover tests in test_engine_handover.py run
over NIXL too.)"""

from __future__ import annotations

import sys
import time

import pytest
import torch
from baton.services.kv_transfer.config import FaultInjection, KVTransferConfig
from baton.services.kv_transfer.factory import create_connector
from baton.services.kv_transfer.nixl_layout import CacheLayout, decode_blocks, encode_blocks


@pytest.fixture
def transport() -> str:  # narrows conftest.connect to this transport
    return "nixl"


SHAPE = (2, 40, 4, 2, 8)  # [K/V, blocks, block size, kv heads, head dim]


def test_missing_nixl_fails_clearly_at_start_up(monkeypatch):
    for module in ("nixl", "nixl._api", "nixl_cu12", "nixl_cu12._api"):
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    with pytest.raises(RuntimeError, match="pip install nixl-cu12.*use transport 'torch'"):
        create_connector(KVTransferConfig(role="prefill", transport="nixl"), 0, torch.device("cpu"))


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


@pytest.fixture
def known_pair(connect, receive, outcome):
    """connect(**settings), then one handover: the consumer knows the producer's cache
    layout from that grant, so its next READs start early."""

    def make(**settings):
        p, d = connect(**settings)
        p.add_leases({"t0": (1, 2)})
        receive(p, d, "r0", [1, 2], [3, 4], transfer_id="t0")
        assert outcome(d).finished_recving == {"r0"}
        return p, d

    return make


def lease_and_receive(p, d, receive, request_id="r", transfer_id="t", ended=False):
    """Blocks 5, 6 of the producer into 7, 8 of the consumer; `ended`: the lease ends first."""
    p.add_leases({transfer_id: (5, 6)})
    if ended:
        p.remove_leases([transfer_id])
    receive(p, d, request_id, [5, 6], [7, 8], transfer_id=transfer_id)


def test_a_known_producer_is_read_before_its_grant_which_still_decides(known_pair, receive, outcome):
    p, d = known_pair(verify=True)
    p.set_faults(FaultInjection(delay_s=0.5))
    lease_and_receive(p, d, receive)
    time.sleep(0.25)  # the grant is held back; the READ is not
    assert torch.equal(d.kv_caches[2][:, [7, 8]], p.kv_caches[2][:, [5, 6]])
    assert d.has_pending()
    status = outcome(d)
    assert status.finished_recving == {"r"} and not status.failed_recving


def test_an_early_read_of_an_ended_lease_fails_on_the_refusal(known_pair, receive, outcome):
    p, d = known_pair(timeout_s=5.0)
    lease_and_receive(p, d, receive, "late", ended=True)
    assert "expired" in outcome(d).failed_recving["late"]
    lease_and_receive(p, d, receive, "next", transfer_id="t2")
    assert outcome(d).finished_recving == {"next"}


def test_an_early_read_with_a_wrong_checksum_fails(known_pair, receive, outcome):
    p, d = known_pair(verify=True)
    p.set_faults(FaultInjection(corrupt=True))
    lease_and_receive(p, d, receive)
    assert "checksum mismatch" in outcome(d).failed_recving["r"]


def test_an_early_read_from_a_layout_that_changed_reads_the_new_caches(known_pair, receive, outcome):
    """A producer that registered new caches (it slept and woke): a READ made from the layout
    of its earlier grant must not count; the consumer fetches the producer's metadata again
    and reads the new memory."""
    p, d = known_pair(verify=True)
    p.register_kv_caches([torch.randn(SHAPE) for _ in range(3)])  # new memory: new bases
    lease_and_receive(p, d, receive)
    status = outcome(d)
    assert status.finished_recving == {"r"} and not status.failed_recving
    for layer in range(3):
        assert torch.equal(d.kv_caches[layer][:, [7, 8]], p.kv_caches[layer][:, [5, 6]])
