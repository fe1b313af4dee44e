"""sleep/wake_up: level 1 frees the KV-cache tensors, level 2 the weights too (in tensor
bytes, and the KV cache in the process's resident memory); a sleeping engine refuses
requests with EngineSleepingError."""

from __future__ import annotations

import gc
import os

import pytest
from baton.services.engine import LLM, AsyncLLM, SamplingParams
from baton.services.engine.errors import EngineSleepingError
from testlib.weight_updates import MAX_TOKENS, PROMPTS, assert_equals_hf

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=1)


@pytest.fixture
def llm(old_dir):
    llm = LLM(model=str(old_dir), num_kv_blocks=64)
    yield llm
    llm.shutdown()


def test_level_1_frees_and_restores_the_kv_cache(llm, old_dir):
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    llm.generate(ids, GREEDY)
    kv_bytes, weight_bytes = llm.core.weights.memory_bytes()
    assert kv_bytes == llm.core.num_kv_blocks * llm.core.executor.rank.runner.kv_block_bytes
    llm.sleep(1)
    assert llm.core.weights.memory_bytes() == (0, weight_bytes)
    assert not llm.core.scheduler.kv.pool.cached  # the prefix cache went with the K/V
    with pytest.raises(EngineSleepingError, match="asleep"):
        llm.generate(ids, GREEDY)
    llm.wake_up()
    assert llm.core.weights.memory_bytes() == (kv_bytes, weight_bytes)
    outputs = llm.generate(ids, GREEDY)
    assert_equals_hf(old_dir, ids, outputs)
    assert all(o.num_cached_tokens == 0 for o in outputs)
    llm.core.check_integrity()


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads resident memory from /proc")
@pytest.mark.parametrize("cache_mib", [256, 48], ids=["layers-mmapped", "layers-in-heap"])
def test_level_1_gives_the_kv_memory_back_to_the_system(old_dir, cache_mib):
    """A KV cache large enough to dwarf the rest: the process's resident memory drops by it on
    sleep and grows by it again on wake_up (the cache comes back zeroed: its pages touched).
    At 256 MiB each layer's tensor is past malloc's mmap threshold, so freeing it unmaps it;
    at 48 MiB each (24 MiB) is under the 32 MiB threshold the CPU tuning sets and lives in
    malloc's heap, which keeps freed memory unless sleep trims it."""
    llm = LLM(model=str(old_dir), kv_cache_memory_bytes=cache_mib * 2**20)
    try:
        kv_bytes, _ = llm.core.weights.memory_bytes()
        assert kv_bytes >= 0.97 * cache_mib * 2**20
        llm.generate(["A"], GREEDY)
        gc.collect()
        awake = resident_bytes()
        llm.sleep(1)
        gc.collect()
        asleep = resident_bytes()
        assert awake - asleep >= 0.9 * kv_bytes, (awake, asleep, kv_bytes)
        llm.wake_up()
        assert resident_bytes() - asleep >= 0.9 * kv_bytes
        assert llm.generate(["A"], GREEDY)[0].finished
    finally:
        llm.shutdown()


def test_level_2_frees_the_weights_until_an_update_loads_them(llm, new_dir):
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    kv_bytes, weight_bytes = llm.core.weights.memory_bytes()
    llm.sleep(2)
    assert llm.core.weights.memory_bytes() == (0, 0)
    llm.wake_up()
    assert llm.core.weights.memory_bytes() == (kv_bytes, 0)
    with pytest.raises(EngineSleepingError, match="update_weights_from"):
        llm.generate(ids, GREEDY)
    with pytest.raises(Exception, match="lacks tensors"):  # nothing to keep: every tensor is needed
        llm.update_weights_from_tensors([])
    llm.update_weights_from_disk(str(new_dir))
    assert llm.core.weights.memory_bytes() == (kv_bytes, weight_bytes)
    assert_equals_hf(new_dir, ids, llm.generate(ids, GREEDY))


def test_an_update_may_come_before_wake_up(llm, new_dir):
    llm.sleep(2)
    llm.update_weights_from_disk(str(new_dir))
    with pytest.raises(EngineSleepingError):
        llm.generate(["A"], GREEDY)
    llm.wake_up()
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    assert_equals_hf(new_dir, ids, llm.generate(ids, GREEDY))


def test_sleep_needs_an_idle_engine(llm):
    llm.core.add_request("busy", "A", SamplingParams(max_tokens=4))
    with pytest.raises(RuntimeError, match="idle"):
        llm.sleep(1)


async def test_async_engine_refuses_requests_while_asleep(old_dir):
    engine = AsyncLLM.from_kwargs(str(old_dir), num_kv_blocks=64)
    try:
        await engine.sleep(1)
        with pytest.raises(EngineSleepingError):
            engine.add_request("r", "A", GREEDY)
        await engine.wake_up()
        outputs = [o async for o in engine.generate("r", "A", GREEDY)]
        assert outputs[-1].finished
    finally:
        engine.shutdown()
