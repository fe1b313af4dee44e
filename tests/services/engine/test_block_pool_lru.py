"""Prefix-cache eviction order and O(1) revival, checked directly on the pool, plus a
property test over random allocate / extend / free / hit sequences."""

from __future__ import annotations

from baton.services.engine.api.sampling_params import SamplingParams
from baton.services.engine.core.block_hash import hash_request_tokens
from baton.services.engine.core.kv_cache_manager import KVCacheManager
from baton.services.engine.core.request import Request
from hypothesis import given, settings
from hypothesis import strategies as st
from testlib.fake_clock import FakeClock

B = 4


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, list(tokens), SamplingParams(), frozenset(), max_tokens=1000)


def run_prefill(kv: KVCacheManager, request: Request) -> list[int]:
    hits, num_hit = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_hit, hits) is not None
    request.num_computed_tokens = request.num_tokens
    return kv.get_block_ids(request.request_id)


def test_freed_blocks_stay_cached_and_tail_blocks_go_first():
    kv = KVCacheManager(block_size=B, num_blocks=6)
    request = make_request("a", range(100, 113))  # 3 full blocks + 1 token
    ids = run_prefill(kv, request)
    kv.free(request)
    assert kv.num_free_blocks == 6
    assert len(kv.pool.cached_block_hashes()) == 3
    # Free queue: the two never-used blocks, then a's blocks tail first.
    queue = [b.block_id for b in kv.pool.free_queue]
    assert queue == [4, 5, ids[3], ids[2], ids[1], ids[0]]
    # Allocating 4 new blocks evicts a's last full block (ids[2]) before its first two.
    other = make_request("b", range(500, 516))
    run_prefill(kv, other)
    expected = hash_request_tokens(list(range(100, 113)), B)
    assert kv.pool.cached_block_hashes() & set(expected) == set(expected[:2])
    removed = [h for e in kv.pool.take_events() if type(e).__name__ == "BlockRemoved" for h in e.block_hashes]
    assert removed == [expected[2]]
    kv.check_integrity()


def test_hit_revives_a_free_block_in_place():
    kv = KVCacheManager(block_size=B, num_blocks=8)
    first = make_request("a", range(100, 109))
    ids = run_prefill(kv, first)
    kv.free(first)
    again = make_request("b", range(100, 109))
    hits, num_hit = kv.get_computed_blocks(again)
    assert [b.block_id for b in hits] == ids[:2] and num_hit == 8
    assert all(b.ref_cnt == 0 for b in hits)
    kv.allocate_slots(again, 1, hits)
    assert all(b.ref_cnt == 1 for b in hits)
    assert all(b.block_id not in {f.block_id for f in kv.pool.free_queue} for b in hits)
    kv.check_integrity()


def test_a_hit_checks_tokens_not_just_the_hash():
    kv = KVCacheManager(block_size=B, num_blocks=8)
    run_prefill(kv, make_request("a", range(100, 109)))
    block = kv.pool.cached[hash_request_tokens(list(range(100, 109)), B)[0]]
    block.token_ids = (1, 2, 3, 4)  # as if two prefixes collided on one hash
    hits, num_hit = kv.get_computed_blocks(make_request("b", range(100, 109)))
    assert hits == [] and num_hit == 0


def assert_prefix_closed(kv: KVCacheManager, sequences: list[tuple[int, ...]]) -> None:
    """The cache never holds a block without its whole prefix: of each sequence it holds the
    first k blocks. The router's index search relies on it (services/router/prefix_index.py)."""
    cached = kv.pool.cached_block_hashes()
    for tokens in sequences:
        held = [h in cached for h in hash_request_tokens(list(tokens), B)]
        assert held == sorted(held, reverse=True), (tokens, held)


operations = st.lists(
    st.tuples(st.sampled_from(["add", "extend", "free", "wait"]), st.integers(0, 7), st.integers(1, 14)),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(operations)
def test_random_operations_keep_the_invariants(ops):
    clock = FakeClock(1000.0)
    kv = KVCacheManager(block_size=B, num_blocks=16, warm_window_s=5, clock=clock)
    live: dict[str, Request] = {}
    sequences: list[tuple[int, ...]] = []  # every request's tokens, as added and as extended
    counter = 0
    for op, choice, length in ops:
        if op == "add":
            counter += 1
            # A tiny alphabet and shared starts make prefix hits frequent.
            tokens = [(choice + i // 3) % 4 for i in range(length)]
            request = make_request(f"r{counter}", tokens)
            sequences.append(tuple(tokens))
            hits, num_hit = kv.get_computed_blocks(request)
            if kv.allocate_slots(request, request.num_tokens - num_hit, hits) is not None:
                request.num_computed_tokens = request.num_tokens
                live[request.request_id] = request
        elif op == "extend" and live:
            request = list(live.values())[choice % len(live)]
            for t in range(length % 5 + 1):
                request.append_output_token(t % 4)
            new = request.num_tokens - request.num_computed_tokens
            if kv.allocate_slots(request, new) is not None:
                request.num_computed_tokens = request.num_tokens
                sequences.append(tuple(request.all_token_ids))
        elif op == "free" and live:
            request = live.pop(list(live)[choice % len(live)])
            kv.free(request)
        elif op == "wait":
            clock.now += length
        # Warm: the cached free blocks stamped within the window (check_integrity holds the
        # counts to the stamps; the stamps are checked by the deterministic tests below).
        warm = [b for b in kv.pool.free_queue if b.block_hash is not None and b.freed_second >= int(clock.now - 5)]
        assert kv.pool.num_warm_free_blocks == len(warm)
        kv.check_integrity()
        assert_prefix_closed(kv, sequences)
    for request in live.values():
        kv.free(request)
    kv.check_integrity()
    assert kv.num_free_blocks == 16


def test_the_cache_stays_prefix_closed_when_a_cached_copy_is_evicted():
    clock = FakeClock(1000.0)
    kv = KVCacheManager(block_size=B, num_blocks=16, warm_window_s=5, clock=clock)
    live: dict[str, Request] = {}
    sequences = []
    for i, (choice, length) in enumerate([(0, 9), (2, 8), (2, 8), (0, 1), (0, 1), (0, 1), (0, 1), (0, 1), (1, 13)]):
        request = make_request(f"r{i}", [(choice + j // 3) % 4 for j in range(length)])
        sequences.append(tuple(request.all_token_ids))
        hits, num_hit = kv.get_computed_blocks(request)
        if kv.allocate_slots(request, request.num_tokens - num_hit, hits) is not None:
            request.num_computed_tokens = request.num_tokens
            live[request.request_id] = request
    kv.free(live.pop(list(live)[1]))  # the request whose copy of the prompt's blocks is cached
    request = list(live.values())[1]
    for t in range(14 % 5 + 1):  # the request holding the unregistered duplicate decodes on
        request.append_output_token(t % 4)
    assert kv.allocate_slots(request, request.num_tokens - request.num_computed_tokens) is not None
    request.num_computed_tokens = request.num_tokens
    sequences.append(tuple(request.all_token_ids))
    assert_prefix_closed(kv, sequences)
    kv.check_integrity()


def test_a_twin_takes_over_an_evicted_registration_and_lends_its_place_when_freed():
    kv = KVCacheManager(block_size=B, num_blocks=6)
    first = make_request("a", range(100, 108))  # two full blocks: the second is the last prompt block
    run_prefill(kv, first)
    twin_request = make_request("b", range(100, 108))  # hits block 1, recomputes block 2: a twin
    twin_ids = run_prefill(kv, twin_request)
    hashes = hash_request_tokens(list(range(100, 108)), B)
    cached_copy = kv.pool.cached[hashes[1]]
    assert cached_copy.block_id != twin_ids[1]
    kv.free(first)
    kv.pool.take_events()
    other = make_request("c", range(500, 516))
    run_prefill(kv, other)  # takes every free block: the cached copy is evicted
    assert kv.pool.cached[hashes[1]].block_id == twin_ids[1]  # the twin holds the registration now
    assert not [e for e in kv.pool.take_events() if hashes[1] in getattr(e, "block_hashes", ())]
    kv.check_integrity()
    kv.free(other)

    again = make_request("d", range(100, 108))
    again_ids = run_prefill(kv, again)  # block 2 is a twin of the (in-use) registered block
    kv.free(twin_request)  # the registered block is freed ...
    kv.free(again)  # ... then its twin: the registered block moves to the twin's place
    order = [b.block_id for b in kv.pool.free_queue]
    assert order.index(twin_ids[1]) > order.index(again_ids[1])
    kv.check_integrity()


def test_warm_blocks_are_cached_free_blocks_used_within_the_window():
    clock = FakeClock(1000.0)
    kv = KVCacheManager(block_size=B, num_blocks=12, warm_window_s=30, clock=clock)
    assert kv.pool.num_warm_free_blocks == 0  # never-used blocks are cold
    first = make_request("a", range(100, 109))  # 2 full blocks + 1 token
    run_prefill(kv, first)
    assert kv.pool.num_warm_free_blocks == 0  # in use, not free
    kv.free(first)
    assert kv.pool.num_warm_free_blocks == 2  # the partial block holds no prefix
    clock.now += 20
    second = make_request("b", range(200, 213))  # 3 full blocks + 1
    run_prefill(kv, second)
    kv.free(second)
    assert kv.pool.num_warm_free_blocks == 5
    clock.now += 15
    assert kv.pool.num_warm_free_blocks == 3  # a's blocks were last used 35 s ago
    # A hit revives a's blocks (in use: not free); freed again, they are warm again.
    again = make_request("c", range(100, 109))
    hits, num_hit = kv.get_computed_blocks(again)
    kv.allocate_slots(again, again.num_tokens - num_hit, hits)
    assert kv.pool.num_warm_free_blocks == 3
    kv.free(again)
    assert kv.pool.num_warm_free_blocks == 5
    kv.check_integrity()
    # Eviction cools: 12 new blocks take every free block, cached or not.
    big = make_request("d", range(300, 348))
    run_prefill(kv, big)
    assert kv.pool.num_warm_free_blocks == 0
    kv.free(big)
    assert kv.pool.num_warm_free_blocks == 12
    kv.reset_prefix_cache()
    assert kv.pool.num_warm_free_blocks == 0
    kv.check_integrity()


def test_a_freed_twin_warms_the_cached_copy():
    clock = FakeClock(1000.0)
    kv = KVCacheManager(block_size=B, num_blocks=12, warm_window_s=30, clock=clock)
    tokens = list(range(100, 108))  # exactly 2 blocks: the last one is always recomputed
    holder = make_request("a", tokens)
    run_prefill(kv, holder)
    kv.free(holder)
    clock.now += 100  # a's blocks are cold
    assert kv.pool.num_warm_free_blocks == 0
    twin = make_request("b", tokens)
    run_prefill(kv, twin)  # hits block 1, recomputes block 2 into a twin
    kv.free(twin)
    # Block 1 was used by b; block 2's cached copy takes the twin's place and is warm too.
    assert kv.pool.num_warm_free_blocks == 2
    kv.check_integrity()
