"""With a real engine (tiny model): router hashes equal engine hashes, events steer placement."""

from __future__ import annotations

import asyncio
import time

import pytest
from baton.services.engine import AsyncLLM, EngineConfig, EngineCore, SamplingParams
from baton.services.engine.core.kv_events import BlockStored, InMemoryKVEventPublisher
from baton.services.router import PlacementReason, PrefixRouter, PromptHasher, WorkerAgent
from testlib.losing_publisher import LosingPublisher
from testlib.router_setup import make_config, make_index, make_info

BLOCK_SIZE = 4
SHARED = "def handle(request):\n    user = authenticate(request.headers)\n    return render(user, "


def engine_config(model_dir) -> EngineConfig:
    return EngineConfig.from_kwargs(model=str(model_dir), block_size=BLOCK_SIZE, num_kv_blocks=96)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("cache_salt", [None, "tenant-7"])
def test_router_hashes_equal_the_engines(llama_dir, cache_salt):
    publisher = InMemoryKVEventPublisher()
    core = EngineCore(engine_config(llama_dir), kv_event_publisher=publisher)
    hasher = PromptHasher.from_model(llama_dir, BLOCK_SIZE)
    text = SHARED + "'index.html')"
    token_ids = hasher.token_ids(text)
    assert token_ids == core.prepare("check", text).prompt_token_ids  # the engine's own tokenization
    core.add_request("r", text, greedy(3), cache_salt=cache_salt)
    while core.has_unfinished_requests():
        core.step()
    stored = [h for e in publisher.events if isinstance(e, BlockStored) for h in e.block_hashes]
    router_hashes = hasher.block_hashes(token_ids, cache_salt)
    assert len(router_hashes) == len(token_ids) // BLOCK_SIZE >= 5
    assert stored[: len(router_hashes)] == router_hashes
    assert set(router_hashes) <= core.scheduler.kv.pool.cached_block_hashes()


async def cached_hashes(engine: AsyncLLM) -> set[bytes]:
    return await engine.run_in_engine(lambda core: core.scheduler.kv.pool.cached_block_hashes())


async def wait_in_sync(index, agent: WorkerAgent, engine: AsyncLLM, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while index.cached_blocks(agent.info.worker_id) != await cached_hashes(engine):
        assert time.monotonic() < deadline, "the index never caught up with the engine"
        await asyncio.sleep(0.02)


async def run(engine: AsyncLLM, request_id: str, prompt: str, max_tokens: int = 4) -> None:
    async for _ in engine.generate(request_id, prompt, greedy(max_tokens)):
        pass


async def test_events_from_a_real_engine_steer_placement(llama_dir, redis_server):
    config = make_config(redis_server)
    agents, engines = {}, {}
    for name in ("a", "b"):
        agents[name] = WorkerAgent.from_config(config, make_info(name, address=f"replica-{name}"))
        engines[name] = AsyncLLM(engine_config(llama_dir), kv_event_publisher=agents[name].publisher)
        agents[name].start(engines[name].stats)
    index = make_index(config)
    hasher = PromptHasher.from_model(llama_dir, BLOCK_SIZE)
    router = PrefixRouter(config, index, hasher=hasher)
    try:
        await run(engines["a"], "warm", SHARED + "'index.html')")
        await wait_in_sync(index, agents["a"], engines["a"])
        assert index.cached_blocks(agents["a"].info.worker_id)

        same_prefix = hasher.token_ids(SHARED + "'about.html', status=200)")
        placement = router.route_prefill("p1", same_prefix)
        assert placement.reason is PlacementReason.PREFIX
        assert placement.worker_ids[0] == agents["a"].info.worker_id
        assert placement.best.num_cached_blocks >= len(hasher.token_ids(SHARED)) // BLOCK_SIZE - 1

        busy = asyncio.ensure_future(run(engines["a"], "long", "a long story", max_tokens=150))
        while index.query("prefill", [])[0].load.num_running != 1:  # a's load report shows the request
            assert not busy.done()
            await asyncio.sleep(0.01)
        unrelated = router.route_prefill("p2", hasher.token_ids("Unicode: héllo wörld — ☃ ✓ and more"))
        assert unrelated.reason is PlacementReason.LOAD
        assert unrelated.worker_ids[0] == agents["b"].info.worker_id
        busy.cancel()
    finally:
        for name in agents:
            engines[name].shutdown()
            agents[name].close()


async def test_a_lost_batch_from_a_real_engine_heals_by_snapshot(llama_dir, redis_server):
    config = make_config(redis_server)
    agent = WorkerAgent.from_config(config, make_info("a"))
    losing = LosingPublisher(agent.publisher)
    engine = AsyncLLM(engine_config(llama_dir), kv_event_publisher=losing)
    agent.start(engine.stats)
    index = make_index(config)
    try:
        await run(engine, "one", SHARED + "'one.html')")
        await wait_in_sync(index, agent, engine)
        losing.lose_next = True
        await run(engine, "two", "import os\nimport sys\n\nclass Config:", max_tokens=8)  # its first batch is lost
        await run(engine, "three", "The quick brown fox jumps over the lazy dog because")  # a later batch shows the gap
        await wait_in_sync(index, agent, engine)
        assert agent.counters.resyncs["gap"] == 1 and not losing.lose_next
    finally:
        engine.shutdown()
        agent.close()
