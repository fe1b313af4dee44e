"""The NIXL connector on its own (reading over UCX from DRAM), beyond what test_connectors.py
checks on every transport. (The engine-level handover tests in test_engine_handover.py run
over NIXL too.)"""

from __future__ import annotations

import sys

import pytest
import torch
from baton.services.kv_transfer.config import KVTransferConfig
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
