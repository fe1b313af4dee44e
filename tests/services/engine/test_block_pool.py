"""Block pool and KV-cache manager: accounting, LRU free queue, slot allocation, forks."""

from __future__ import annotations

import pytest
from baton.services.engine.api.sampling_params import SamplingParams
from baton.services.engine.core.block_pool import BlockPool
from baton.services.engine.core.kv_cache_manager import KVCacheManager
from baton.services.engine.core.request import Request


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams(), frozenset(), max_tokens=100)


def test_allocate_and_free_keep_the_books():
    pool = BlockPool(8, enable_caching=False)
    blocks = pool.get_new_blocks(5)
    assert pool.num_free_blocks == 3
    pool.check_integrity()
    pool.free_blocks(blocks)
    assert pool.num_free_blocks == 8
    pool.check_integrity()
    with pytest.raises(RuntimeError, match="asked for 9"):
        pool.get_new_blocks(9)


def test_free_queue_is_lru():
    pool = BlockPool(4, enable_caching=False)
    a, b, c, d = pool.get_new_blocks(4)
    pool.free_blocks([c, a])
    pool.free_blocks([d, b])
    assert [blk.block_id for blk in pool.get_new_blocks(4)] == [c.block_id, a.block_id, d.block_id, b.block_id]


def test_allocate_slots_grows_by_blocks_and_reports_shortage():
    kv = KVCacheManager(block_size=4, num_blocks=5, enable_caching=False)
    request = make_request("r", list(range(10)))
    assert len(kv.allocate_slots(request, 10)) == 3  # 10 tokens -> 3 blocks of 4
    request.num_computed_tokens = 10
    request.append_output_token(1)
    assert kv.allocate_slots(request, 1) == []  # slot 11 fits in block 3
    request.num_computed_tokens = 11
    for _ in range(2):
        request.append_output_token(1)
    assert len(kv.allocate_slots(request, 2)) == 1
    other = make_request("o", list(range(9)))
    assert kv.allocate_slots(other, 9) is None  # needs 3, only 1 free
    assert "o" not in kv.req_to_blocks
    kv.check_integrity()
    kv.free(request)
    assert kv.num_free_blocks == 5
    kv.check_integrity()


def test_fork_shares_blocks_and_copies_the_partial_one_on_write():
    kv = KVCacheManager(block_size=4, num_blocks=8, enable_caching=False)
    parent = make_request("p", list(range(6)))
    kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    child = make_request("c", list(range(6)))
    kv.fork(parent, child)
    child.num_computed_tokens = 6
    assert kv.get_block_ids("c") == kv.get_block_ids("p")
    kv.check_integrity()
    for r in (parent, child):
        r.append_output_token(7)
    kv.allocate_slots(child, 1)  # writes slot 6, inside the shared partial block 1
    copies = kv.take_block_copies()
    assert copies == [(kv.get_block_ids("p")[1], kv.get_block_ids("c")[1])]
    assert kv.get_block_ids("c")[0] == kv.get_block_ids("p")[0]
    kv.allocate_slots(parent, 1)  # the parent now owns its block alone: no copy
    assert kv.take_block_copies() == []
    kv.check_integrity()
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == 8
    kv.check_integrity()
