"""Prefix caching: same outputs as without, exact hit counts, hashes shared with the router,
events that replay to the pool's state, and an LRU that survives requests."""

from __future__ import annotations

import random
import time

import pytest
from baton.services.engine import LLM, SamplingParams
from baton.services.engine.core.block_hash import hash_request_tokens
from baton.services.engine.core.kv_events import AllBlocksCleared, BlockStored, InMemoryKVEventPublisher, apply_events
from baton.services.engine.engine_core import EngineCore

BLOCK = 16
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def prompt_tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


@pytest.fixture(scope="module")
def prompts():
    base = prompt_tokens(1, 64)  # 4 full blocks
    return {
        "base": base,
        "share_0": prompt_tokens(2, 64),
        "share_50": base[:32] + prompt_tokens(3, 32),
        "share_100": list(base),
        "longer": base + prompt_tokens(4, 21),  # 5 full blocks + 5 tokens; the first 4 are base's
    }


# A hit never covers the last prompt token: floor((len - 1) / B) * B at most.
EXPECTED_CACHED = {"share_0": 0, "share_50": 32, "share_100": 48, "longer": 64}


@pytest.mark.parametrize("name", list(EXPECTED_CACHED))
def test_cached_outputs_equal_uncached_with_exact_hits(llama_dir, prompts, name):
    cached = LLM(model=str(llama_dir), num_kv_blocks=128, block_size=BLOCK)
    uncached = LLM(model=str(llama_dir), num_kv_blocks=128, block_size=BLOCK, enable_prefix_caching=False)
    for llm in (cached, uncached):
        (warm,) = llm.generate([prompts["base"]], GREEDY)
        assert warm.num_cached_tokens == 0
    (hit,) = cached.generate([prompts[name]], GREEDY)
    (miss,) = uncached.generate([prompts[name]], GREEDY)
    assert hit.token_ids == miss.token_ids
    assert hit.num_cached_tokens == EXPECTED_CACHED[name]
    assert miss.num_cached_tokens == 0
    cached.core.check_integrity()


def test_hits_within_one_batch(llama_dir, prompts):
    llm = LLM(model=str(llama_dir), num_kv_blocks=128, block_size=BLOCK)
    outs = llm.generate([prompts["base"], prompts["share_100"]], GREEDY)
    assert outs[0].token_ids == outs[1].token_ids
    assert [o.num_cached_tokens for o in outs] == [0, 48]


def test_engine_block_hashes_equal_the_standalone_function(llama_dir, prompts):
    llm = LLM(model=str(llama_dir), num_kv_blocks=128, block_size=BLOCK)
    out = llm.generate([prompts["longer"]], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    all_tokens = prompts["longer"] + out.token_ids
    # Every full block the request computed (the last sampled token is never computed).
    expected = hash_request_tokens(all_tokens[:-1], BLOCK)
    assert set(expected) <= llm.core.scheduler.kv.pool.cached_block_hashes()
    assert len(expected) == (len(all_tokens) - 1) // BLOCK


def test_cache_salt_isolates_prefixes(llama_dir, prompts):
    llm = LLM(model=str(llama_dir), num_kv_blocks=128, block_size=BLOCK)
    engine = llm.core
    engine.add_request("a", prompts["base"], GREEDY, cache_salt="tenant-a")
    engine.add_request("b", prompts["base"], GREEDY, cache_salt="tenant-b")
    engine.add_request("c", prompts["base"], GREEDY, cache_salt="tenant-a")
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert [finished[r].num_cached_tokens for r in "abc"] == [0, 0, 48]


def test_events_replay_to_the_pool_state(llama_dir):
    publisher = InMemoryKVEventPublisher()
    from baton.services.engine.config import EngineConfig

    engine = EngineCore(
        EngineConfig.from_kwargs(model=str(llama_dir), num_kv_blocks=24, block_size=BLOCK), kv_event_publisher=publisher
    )
    rng = random.Random(7)
    shared = prompt_tokens(9, 48)
    for i in range(30):  # many requests through a small cache: stores and evictions
        prompt = shared[: rng.choice([16, 32, 48])] + prompt_tokens(100 + i, rng.randrange(1, 40))
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=rng.randrange(1, 30), temperature=0))
        for _ in range(rng.randrange(1, 4)):
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    events = publisher.events
    assert [e.seq for e in events] == list(range(len(events)))
    assert any(not isinstance(e, (BlockStored, AllBlocksCleared)) for e in events), "expected evictions"
    assert apply_events(set(), events) == engine.scheduler.kv.pool.cached_block_hashes()
    engine.scheduler.kv.reset_prefix_cache()
    engine.publish_kv_events()
    assert apply_events(set(), publisher.events) == set()


def test_stats_report_warm_free_blocks(llama_dir, prompts):
    """The blocks a finished request leaves cached count as warm until the window passes."""
    llm = LLM(model=str(llama_dir), num_kv_blocks=128, block_size=BLOCK, warm_window_s=1)
    assert llm.core.stats().num_warm_free_kv_blocks == 0
    llm.generate([prompts["base"]], GREEDY)  # 64 + 12 tokens: 4 full blocks cached, 1 partial
    assert llm.core.stats().num_warm_free_kv_blocks == 4
    time.sleep(2.1)
    assert llm.core.stats().num_warm_free_kv_blocks == 0
